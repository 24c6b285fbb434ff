"""OpenTelemetry traces (docs/tracing.md): the enqueuer's trace context stored with its
items, a CONSUMER span per handler run linked to it, with the messaging semantic
conventions' attributes and the handler's exception recorded; and nothing at all
without the ``opentelemetry`` extra.

The SDK's in-memory exporter shows what a project's exporter would receive.
"""

import sys

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from django_txqueue import Queue, on_commit
from django_txqueue.models import QueueItem
from django_txqueue.observe import tracing
from django_txqueue.tasks.backend import TASKS_FRAMEWORK, run_task
from tests.helpers import run_until_finished

otel_trace = pytest.importorskip("opentelemetry.trace")
sdk_trace = pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)

pytestmark = pytest.mark.usefixtures("fast_consumers")

EXPORTER = InMemorySpanExporter()


def tracer_provider():
    """The process's SDK tracer provider, set once (OpenTelemetry allows one), with the
    in-memory exporter among its processors."""
    provider = otel_trace.get_tracer_provider()
    if not isinstance(provider, sdk_trace.TracerProvider):
        provider = sdk_trace.TracerProvider()
        otel_trace.set_tracer_provider(provider)
    if not getattr(provider, "_txqueue_test_exporter", False):
        provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
        provider._txqueue_test_exporter = True
    return provider


@pytest.fixture
def spans():
    """The spans ended during the test, as exported."""
    tracer_provider()
    EXPORTER.clear()
    yield EXPORTER.get_finished_spans
    EXPORTER.clear()


@pytest.fixture
def tracer(spans):
    return otel_trace.get_tracer("tests.test_tracing")


def traceparent(span):
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


def stored_context(item):
    return QueueItem.objects.get(pk=item.pk).trace_context


def processed(spans, queue_name):
    return [span for span in spans() if span.name == f"process {queue_name}"]


# -- producing -----------------------------------------------------------------------


def test_an_item_enqueued_in_a_span_stores_its_w3c_trace_context(db, tracer):
    with tracer.start_as_current_span("checkout") as request:
        item = Queue("traced").enqueue({"order": 1})
    assert stored_context(item) == {"traceparent": traceparent(request)}


def test_enqueue_many_stores_the_context_with_every_item(db, tracer):
    with tracer.start_as_current_span("import") as request:
        items = Queue("traced").enqueue_many([{"n": n} for n in range(3)])
    stored = QueueItem.objects.filter(pk__in=[item.pk for item in items])
    assert [item.trace_context for item in stored] == [{"traceparent": traceparent(request)}] * 3


def test_the_tracestate_is_stored_with_it(db, tracer):
    state = otel_trace.TraceState([("vendor", "abc")])
    parent = otel_trace.SpanContext(0xABC, 0xDEF, is_remote=True, trace_state=state)
    context = otel_trace.set_span_in_context(otel_trace.NonRecordingSpan(parent))
    with tracer.start_as_current_span("handler", context=context):
        item = Queue("traced").enqueue({})
    assert stored_context(item)["tracestate"] == "vendor=abc"


def test_without_an_active_span_nothing_is_stored_or_written(db, tracer):
    with CaptureQueriesContext(connection) as queries:
        item = Queue("traced").enqueue({})
    assert stored_context(item) is None
    [insert] = [q["sql"] for q in queries if q["sql"].startswith("INSERT")]
    assert "trace_context" not in insert  # the INSERT's shape is the one without tracing


def test_on_commit_stores_the_context_of_its_caller(db, tracer):
    with tracer.start_as_current_span("signup") as request, transaction.atomic():
        on_commit(print, "welcome")
        item = QueueItem.objects.get(queue="django_txqueue.on_commit")
        assert item.trace_context == {"traceparent": traceparent(request)}


@pytest.mark.skipif(TASKS_FRAMEWORK is None, reason="no Tasks framework")
def test_a_django_task_stores_the_context_of_its_caller(db, tracer):
    from tests.testapp import tasks

    with tracer.start_as_current_span("view") as request:
        result = tasks.add.enqueue(1, 2)
    assert QueueItem.objects.get(pk=result.id).trace_context == {
        "traceparent": traceparent(request)
    }


# -- consuming -----------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_each_handler_run_is_a_consumer_span_linked_to_the_enqueuing_span(spans, tracer):
    inner = []

    def handler(item):
        with tracer.start_as_current_span("charge card") as span:
            inner.append(span)

    with tracer.start_as_current_span("checkout") as request:
        items = Queue("traced").enqueue_many([{"n": 1}, {"n": 2}])
    worker = run_until_finished("traced", handler)

    runs = processed(spans, "traced")
    assert len(runs) == 2
    assert {span.attributes["messaging.message.id"] for span in runs} == {
        str(item.pk) for item in items
    }
    for span in runs:
        assert span.kind == otel_trace.SpanKind.CONSUMER
        # A link to the enqueuing span, in a trace of its own (docs/tracing.md says why).
        [link] = span.links
        assert link.context.trace_id == request.get_span_context().trace_id
        assert link.context.span_id == request.get_span_context().span_id
        assert span.parent is None
        assert span.context.trace_id != request.get_span_context().trace_id
        assert dict(span.attributes) == {
            "messaging.system": "django_txqueue",
            "messaging.destination.name": "traced",
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.message.id": span.attributes["messaging.message.id"],
            "messaging.client.id": worker.identity,
            "txqueue.attempt": 1,
        }
        assert span.status.status_code == otel_trace.StatusCode.UNSET
    # The handler's own spans are children of its run's span.
    assert {span.parent.span_id for span in inner} == {span.context.span_id for span in runs}


@pytest.mark.django_db(transaction=True)
def test_an_item_enqueued_without_a_span_gets_a_span_with_no_link(spans):
    Queue("traced").enqueue({})
    run_until_finished("traced", lambda item: None)
    [span] = processed(spans, "traced")
    assert span.links == () or list(span.links) == []


@pytest.mark.django_db(transaction=True)
def test_a_failing_handler_records_its_exception_on_each_attempts_span(spans, tracer):
    def handler(item):
        raise LookupError("no such seat")

    with tracer.start_as_current_span("booking") as request:
        item = Queue("traced").enqueue({}, max_attempts=2)
    run_until_finished("traced", handler)

    runs = processed(spans, "traced")
    assert [span.attributes["txqueue.attempt"] for span in runs] == [1, 2]
    for span in runs:
        assert span.links[0].context.span_id == request.get_span_context().span_id
        assert span.attributes["messaging.message.id"] == str(item.pk)
        assert span.status.status_code == otel_trace.StatusCode.ERROR
        assert span.status.description == "LookupError: no such seat"
        assert span.attributes["error.type"] == "builtins.LookupError"
        [event] = span.events
        assert event.name == "exception"
        assert event.attributes["exception.type"] == "LookupError"
        assert event.attributes["exception.message"] == "no such seat"
        assert "Traceback" in event.attributes["exception.stacktrace"]


@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(TASKS_FRAMEWORK is None, reason="no Tasks framework")
def test_a_django_task_runs_in_a_span_linked_to_its_caller(spans, tracer):
    from tests.testapp import tasks

    with tracer.start_as_current_span("view") as request:
        result = tasks.add.enqueue(1, 2)
    run_until_finished(tasks.add.queue_name, run_task)
    [span] = processed(spans, tasks.add.queue_name)
    assert span.attributes["messaging.message.id"] == result.id
    assert span.links[0].context.span_id == request.get_span_context().span_id


# -- without the extra ---------------------------------------------------------------


@pytest.fixture
def no_opentelemetry(monkeypatch, spans):
    """As if opentelemetry-api were not installed: importing it fails, and the package
    tries again (the SDK stays configured, so any span made would still be exported)."""
    monkeypatch.setitem(sys.modules, "opentelemetry", None)
    monkeypatch.setattr(tracing, "_api", None)


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("no_opentelemetry")
def test_without_the_extra_nothing_is_stored_traced_or_broken(spans):
    def handler(item):
        if item.payload["fail"]:
            raise ValueError("still reported")

    ok, failing = Queue("traced").enqueue_many([{"fail": False}, {"fail": True}], max_attempts=1)
    worker = run_until_finished("traced", handler)

    assert tracing.api() is False
    assert tracing.current_context() is None
    assert tracing.processing(ok) is tracing.NOTHING
    assert (worker.processed, worker.failed) == (1, 1)
    assert stored_context(ok) is None and stored_context(failing) is None
    assert QueueItem.objects.get(pk=failing.pk).last_error.rstrip().endswith("still reported")
    assert spans() == ()


def test_without_the_extra_the_import_is_tried_once(monkeypatch):
    attempts = []

    class Finder:
        def find_spec(self, name, path=None, target=None):
            if name == "opentelemetry":
                attempts.append(name)
                raise ImportError(name)

    monkeypatch.setattr(sys, "meta_path", [Finder(), *sys.meta_path])
    monkeypatch.delitem(sys.modules, "opentelemetry", raising=False)
    monkeypatch.delitem(sys.modules, "opentelemetry.trace", raising=False)
    monkeypatch.delitem(sys.modules, "opentelemetry.propagate", raising=False)
    monkeypatch.setattr(tracing, "_api", None)
    for _ in range(3):
        assert tracing.current_context() is None
    assert attempts == ["opentelemetry"]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("provider", ["ProxyTracerProvider", "NoOpTracerProvider"])
def test_with_the_api_alone_no_span_is_started(monkeypatch, spans, provider):
    """The API with no SDK set up (installed as another package's dependency, say): its
    spans would record nothing, and the consumer makes none."""
    monkeypatch.setattr(otel_trace, "get_tracer_provider", getattr(otel_trace, provider))
    item = Queue("traced").enqueue({})
    run_until_finished("traced", lambda item: None)
    assert tracing.processing(item) is tracing.NOTHING
    assert spans() == ()


def test_the_admin_shows_an_items_trace_context(admin_client, tracer):
    with tracer.start_as_current_span("checkout") as request:
        item = Queue("traced").enqueue({})
    page = admin_client.get(reverse("admin:django_txqueue_queueitem_change", args=[item.pk]))
    assert page.status_code == 200
    assert traceparent(request) in page.content.decode()
