"""OpenTelemetry traces, with the ``opentelemetry`` extra: the enqueuer's trace context
stored with each item, and a span per handler run linked to it (docs/tracing.md).

Only the API package is used; the project configures the SDK and its exporters. Without
``opentelemetry-api`` every function here does nothing: the import is tried once, on
first use, and what it found is kept.
"""

from __future__ import annotations

import contextlib
from importlib import metadata
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..models import QueueItem

# messaging.system: no registered value fits a queue kept in the project's own SQL
# database; the conventions allow a system's own name.
SYSTEM = "django_txqueue"
# What a consumer span says it does, by messaging.operation.type and .name.
PROCESS = "process"

# The API's modules and the package's tracer, once imported; False: not installed.
_api: Any = None
# What ``processing`` gives without the API: a context manager entering to None.
NOTHING = contextlib.nullcontext()


def api() -> Any:
    """The OpenTelemetry API (``.trace``, ``.propagate``, ``.tracer``), or False."""
    global _api
    if _api is None:
        try:
            from opentelemetry import propagate, trace
        except ImportError:
            _api = False
        else:
            # A proxy until the project sets its tracer provider, then that provider's.
            tracer = trace.get_tracer("django_txqueue", installed_version())
            # Providers whose spans are no-ops: the API's own, while the project sets none.
            idle = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)
            _api = SimpleNamespace(trace=trace, propagate=propagate, tracer=tracer, idle=idle)
    return _api


def installed_version() -> str | None:
    """The package's version, as the tracer's instrumentation scope tells it."""
    try:
        return metadata.version("django-txqueue")
    except metadata.PackageNotFoundError:  # run from a checkout, not installed
        return None


def current_context() -> dict[str, str] | None:
    """The caller's trace context as the configured propagators write it (W3C's
    ``traceparent`` and ``tracestate`` by default), to store with an item; None when no
    span is active, so that such an item's INSERT writes no more than without tracing."""
    otel = api()
    if not otel or not otel.trace.get_current_span().get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    otel.propagate.inject(carrier)
    return carrier or None


def enabled() -> bool:
    """Whether a span would record anything: the API is installed and the project has
    set a tracer provider. Asking costs microseconds (an environment lookup while none
    is set): a consumer asks once, when it starts (``execution.runner``)."""
    otel = api()
    return bool(otel) and not isinstance(otel.trace.get_tracer_provider(), otel.idle)


def processing(item: QueueItem) -> contextlib.AbstractContextManager[Any]:
    """A CONSUMER span "process <queue>" around a handler run, current while it runs
    (the handler's own spans are its children) and linked to the enqueuer's span. Enters
    to the span, or to None without the API or a tracer provider (whose span would
    record nothing, yet cost microseconds)."""
    if not enabled():
        return NOTHING
    otel = api()
    links = []
    if item.trace_context:
        context = otel.propagate.extract(item.trace_context)
        producer = otel.trace.get_current_span(context).get_span_context()
        if producer.is_valid:
            links.append(otel.trace.Link(producer))
    return otel.tracer.start_as_current_span(  # type: ignore[no-any-return]
        f"{PROCESS} {item.queue}",
        kind=otel.trace.SpanKind.CONSUMER,
        links=links,
        attributes={
            "messaging.system": SYSTEM,
            "messaging.destination.name": item.queue,
            "messaging.operation.type": PROCESS,
            "messaging.operation.name": PROCESS,
            "messaging.message.id": str(item.pk),
            "messaging.client.id": item.pid,
            # No generic delivery count in the conventions: 1 on the first run.
            "txqueue.attempt": item.attempts,
        },
        # What the handler raises is caught before the span ends: ``failed`` records it.
        record_exception=False,
        set_status_on_exception=False,
    )


def failed(span: Any, exc: BaseException, error_class: str) -> None:
    """Record the handler's exception on ``span`` (None: no tracing) and mark it ERROR."""
    if span is None:
        return
    otel = api()
    span.record_exception(exc)
    span.set_attribute("error.type", error_class)
    span.set_status(otel.trace.Status(otel.trace.StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
