"""Prometheus metrics (docs/metrics.md): the consumer's endpoint (``run_queue_consumer
--metrics-port``, one process and ``--processes 2``), the Django view (staff, token,
anonymous), bounded labels, the Grafana dashboard's names, and nothing imported or
served without the ``prometheus`` extra.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest
from django.contrib.auth.models import Permission, User
from django.core.management import CommandError
from django.test import override_settings

from django_txqueue import Queue, Status
from django_txqueue.checks import check_metrics_token
from django_txqueue.models import Consumer, QueueItem
from django_txqueue.observe import metrics
from tests.helpers import FAST, ROOT, child_env, worker_for
from tests.helpers import wait_for as poll

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

TOKEN = "t" * 40
COUNTERS = {
    "txqueue_items_processed",
    "txqueue_items_failed",
    "txqueue_items_retried",
    "txqueue_items_rescued",
    "txqueue_items_timed_out",
    "txqueue_consumer_recycles",
}
HISTOGRAMS = {
    "txqueue_handler_duration_seconds",
    "txqueue_enqueue_to_start_seconds",
    "txqueue_claim_batch_size",
}
GAUGES = {
    "txqueue_items",
    "txqueue_oldest_ready_age_seconds",
    "txqueue_live_consumers",
    "txqueue_paused",
    "txqueue_rate_limited_items",
}
METRICS = COUNTERS | HISTOGRAMS | GAUGES
RECYCLE_REASONS = {"max-items", "max-memory", "max-age"}
STATUSES = {"ready", "in_progress", "waiting", "failed", "cancelled", "done"}
START_TIMEOUT = 30
# Every consumer also serves the on_commit calls whose committing process died (outbox.py).
OUTBOX = "django_txqueue.on_commit"


def samples(text):
    """``{(name, frozenset(labels.items())): value}`` of a scrape's text."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(found, name, **labels):
    return found.get((name, frozenset(labels.items())))


def known_queues():
    """The queues a scrape may report without items: configured, or with a handler where
    it runs (a consumer has imported every installed app's ``queues`` module)."""
    from django.conf import settings

    from django_txqueue.consumer import registry

    registry.autodiscover()
    return set(settings.TXQUEUE.get("QUEUES", {})) | set(registry.handlers())


def assert_bounded_labels(text, queues):
    """Every label is a queue name, a status or a histogram bucket: none an item id."""
    queues = set(queues) | known_queues()
    for family in text_string_to_metric_families(text):
        assert family.name in METRICS, family.name
        for sample in family.samples:
            assert set(sample.labels) <= {"queue", "status", "le", "reason"}, sample
            assert sample.labels.get("reason", "max-age") in RECYCLE_REASONS, sample
            assert sample.labels.get("queue", next(iter(queues))) in queues, sample
            assert sample.labels.get("status", "ready") in STATUSES, sample


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        return answer.read().decode()


# -- the consumer's counters, in this process --------------------------------------------


@pytest.fixture
def recorded():
    """This process records metrics into a registry of its own for the test."""
    registry = prometheus_client.CollectorRegistry()
    metrics.recorder = metrics.Recorder(registry)
    yield registry
    metrics.recorder = None


@pytest.mark.django_db(transaction=True)
def test_a_drain_counts_processed_failed_and_retried_per_queue(recorded, fast_consumers):
    Queue("echo").enqueue_many([{"n": n} for n in range(5)])
    Queue("boom").enqueue({"n": 1}, max_attempts=1)  # fails at once
    Queue("boom").enqueue({"n": 2}, max_attempts=2)  # retried once, then fails

    # A retry may not be due yet when a burst run looks: run again until nothing waits.
    for _ in range(20):
        worker_for("echo", "boom", burst=True, batch=2).run()
        if not Queue("boom").items.filter(status=Status.READY).exists():
            break

    get = recorded.get_sample_value
    assert get("txqueue_items_processed_total", {"queue": "echo"}) == 5
    assert get("txqueue_items_failed_total", {"queue": "boom"}) == 2
    assert get("txqueue_items_retried_total", {"queue": "boom"}) == 1
    assert get("txqueue_items_failed_total", {"queue": "echo"}) is None
    assert get("txqueue_handler_duration_seconds_count", {"queue": "echo"}) == 5
    assert get("txqueue_handler_duration_seconds_count", {"queue": "boom"}) == 3
    assert get("txqueue_enqueue_to_start_seconds_count", {"queue": "echo"}) == 5
    assert get("txqueue_enqueue_to_start_seconds_count", {"queue": "boom"}) == 3
    assert get("txqueue_claim_batch_size_sum", {}) == 8  # every claim's items
    assert get("txqueue_claim_batch_size_bucket", {"le": "2.0"}) == get(
        "txqueue_claim_batch_size_count", {}
    )


@pytest.mark.django_db(transaction=True)
def test_a_rescue_is_counted_for_its_queue(recorded, fast_consumers):
    from django_txqueue.consumer.housekeeping import Housekeeping

    stuck = Queue("echo")
    stuck.enqueue({"n": 1})
    stuck.claim(pid="gone", lease=0.001)
    housekeeping = Housekeeping(
        Consumer(identity="metrics-test", host="h", os_pid=1, queues=["echo"]),
        "default",
        queues=lambda: [stuck],
        held=lambda: iter(()),
        lease=None,
        counters=lambda: (0, 0),
        stopping=None,
        on_database_error=lambda: None,
    )
    poll(
        lambda: (
            housekeeping._rescue()
            or recorded.get_sample_value("txqueue_items_rescued_total", {"queue": "echo"})
        ),
        timeout=5,
    )
    assert recorded.get_sample_value("txqueue_items_rescued_total", {"queue": "echo"}) == 1


@pytest.mark.parametrize("batched", [True, False])
def test_observing_a_batch_gives_what_observing_each_value_gives(batched):
    registry = prometheus_client.CollectorRegistry()
    bounds = (0.001, 0.005, 0.01)
    each = prometheus_client.Histogram("each", "", buckets=bounds, registry=registry)
    many = prometheus_client.Histogram("many", "", buckets=bounds, registry=registry)
    values = [0.0, 0.001, 0.0011, 0.005, 0.007, 0.01, 0.02, 5.0]
    for observed in values:
        each.observe(observed)
    # Not batched: a histogram unlike this client's gets plain observe() calls.
    tally = metrics.Tally(many if batched else SimpleNamespace(observe=many.observe))
    tally.add(values[:2])  # all in the first bucket
    tally.add(values[2:])
    tally.flush()
    get = registry.get_sample_value
    for le in ("0.001", "0.005", "0.01", "+Inf"):
        assert get("many_bucket", {"le": le}) == get("each_bucket", {"le": le}), le
    assert get("many_count") == get("each_count") == len(values)
    assert get("many_sum") == pytest.approx(get("each_sum"))


@pytest.mark.parametrize("aware", [True, False])
def test_a_claims_waits_are_seconds_since_due_and_never_below_zero(recorded, aware):
    # Naive where USE_TZ is off: the waits are taken in the claimed values' own zone.
    now = datetime.now(UTC if aware else None)
    due = [now - timedelta(seconds=s) for s in (0.2, 0.2, 3.0)] + [now + timedelta(hours=1)]
    metrics.recorder.claimed([QueueItem(queue="echo", run_at=when) for when in due])

    def get(sample, **labels):
        return recorded.get_sample_value(f"txqueue_enqueue_to_start_seconds_{sample}", labels)

    assert get("count", queue="echo") == 4
    assert get("bucket", queue="echo", le="0.005") == 1  # a clock ahead counts as no wait
    assert get("bucket", queue="echo", le="0.25") == 3
    assert get("bucket", queue="echo", le="2.5") == 3
    assert get("bucket", queue="echo", le="5.0") == 4
    assert get("sum", queue="echo") == pytest.approx(3.4, abs=0.1)
    assert recorded.get_sample_value("txqueue_claim_batch_size_sum") == 4


def test_metrics_are_off_until_asked_for():
    assert metrics.recorder is None


# -- the Django view ---------------------------------------------------------------------


@pytest.fixture
def filled(db):
    Queue("echo").enqueue_many([{"n": n} for n in range(3)])
    Queue("boom").enqueue({"n": 1})
    Queue("boom").pause()


def staff(client, *, permission=True, is_staff=True):
    user = User.objects.create_user("watcher", is_staff=is_staff)
    if permission:
        user.user_permissions.add(Permission.objects.get(codename="view_queueitem"))
    client.force_login(user)


def test_items_held_back_by_a_rate_limit_are_a_gauge(client, db, settings):
    settings.TXQUEUE = {
        **settings.TXQUEUE,
        "QUEUES": {"sms": {"RATE_LIMIT": "2/m"}, "calls": {"RATE_LIMIT_PER_KEY": "1/m"}},
    }
    Queue("sms").enqueue_many([{"n": n} for n in range(5)])
    Queue("calls").enqueue_many([{"n": n} for n in range(3)], key="alice")
    Queue("calls").enqueue_many([{"n": n} for n in range(2)], key="bob")
    Queue("echo").enqueue({"n": 1})
    staff(client)
    found = samples(client.get("/txqueue/metrics").content.decode())
    assert value(found, "txqueue_rate_limited_items", queue="sms") == 0  # nothing spent yet
    assert len(Queue("sms").claim(10, pid="a")) == 2
    assert len(Queue("calls").claim(10, pid="a")) == 2  # alice's first, bob's first
    found = samples(client.get("/txqueue/metrics").content.decode())
    assert value(found, "txqueue_rate_limited_items", queue="sms") == 3
    assert value(found, "txqueue_rate_limited_items", queue="calls") == 3
    assert value(found, "txqueue_rate_limited_items", queue="echo") == 0


def test_the_view_serves_staff_with_the_view_permission(client, filled):
    staff(client)
    answer = client.get("/txqueue/metrics")

    assert answer.status_code == 200
    assert answer["Content-Type"].startswith("text/plain; version=")
    text = answer.content.decode()
    found = samples(text)
    assert value(found, "txqueue_items", queue="echo", status="ready") == 3
    assert value(found, "txqueue_items", queue="boom", status="ready") == 1
    assert value(found, "txqueue_items", queue="echo", status="done") == 0
    assert value(found, "txqueue_paused", queue="boom") == 1
    assert value(found, "txqueue_paused", queue="echo") == 0
    assert value(found, "txqueue_live_consumers", queue="echo") == 0
    assert value(found, "txqueue_oldest_ready_age_seconds", queue="echo") >= 0
    assert_bounded_labels(text, {"echo", "boom"})
    # The web process runs no handlers: its scrape has the database's gauges only.
    assert {family.name for family in text_string_to_metric_families(text)} == GAUGES


def test_a_scrape_reads_no_queue_name_from_the_items(db):
    """The queues are known by name (settings, handlers, Consumer rows, pauses) or found
    by the grouped count of unfinished items: no read of every row per queue name, so a
    scrape's queries do not grow with the queues that only have finished items."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from django_txqueue.observe.collector import queue_rows

    def scrape():
        with CaptureQueriesContext(connection) as queries:
            rows = queue_rows(["default"])
        return rows, len(queries)

    Queue("served").enqueue({})
    Consumer.objects.create(identity="c1", host="h", os_pid=1, queues=["served", "idle"])
    for n in range(3):
        Queue(f"finished-{n}").enqueue({})
    QueueItem.objects.filter(queue__startswith="finished-").update(status=Status.DONE)
    rows, before = scrape()
    for n in range(3, 9):
        Queue(f"finished-{n}").enqueue({})
    QueueItem.objects.filter(queue__startswith="finished-").update(status=Status.DONE)
    rows, after = scrape()
    assert after == before
    assert rows["served"].ready == 1 and rows["idle"].ready == 0  # a consumer's queue
    assert not any(name.startswith("finished-") for name in rows)
    assert known_queues() <= set(rows)


def test_past_a_small_table_done_items_are_the_planners_estimate(db, monkeypatch):
    """DONE items have no index led by their queue: a scrape counts them only while the
    table is small, and past that asks the planner (EXPLAIN, no count)."""
    from django_txqueue.db import dialect_for
    from django_txqueue.observe import reads
    from django_txqueue.observe.collector import queue_rows

    Queue("echo").enqueue({})
    # Reported while all its items are DONE: a consumer serves it.
    Consumer.objects.create(identity="c1", host="h", os_pid=1, queues=["echo"])
    QueueItem.objects.update(status=Status.DONE)
    assert queue_rows(["default"])["echo"].done == 1  # a small table: counted
    dialect = type(dialect_for("default"))
    rows = reads.SCRAPE_COUNTS_UP_TO + 1
    monkeypatch.setattr(dialect, "table_rows", lambda self, queryset: rows)
    monkeypatch.setattr(dialect, "approximate_count", lambda self, queryset: 12_345)
    counted = []
    monkeypatch.setattr(dialect, "estimated_count", lambda self, *args: counted.append(args))
    assert queue_rows(["default"])["echo"].done == 12_345
    assert counted == []  # no bounded count read the table


@override_settings(TXQUEUE={"METRICS_TOKEN": TOKEN})
def test_the_view_serves_a_bearer_of_the_token(client, filled):
    answer = client.get("/txqueue/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert answer.status_code == 200
    assert value(samples(answer.content.decode()), "txqueue_items", queue="echo", status="ready")


@override_settings(TXQUEUE={"METRICS_TOKEN": TOKEN})
@pytest.mark.parametrize("header", [None, "Bearer " + "u" * 40, "Basic " + TOKEN, "Bearer"])
def test_the_view_refuses_anyone_else_with_401(client, filled, header):
    headers = {"Authorization": header} if header else {}
    answer = client.get("/txqueue/metrics", headers=headers)
    assert answer.status_code == 401
    assert answer["WWW-Authenticate"].startswith("Bearer")
    assert b"txqueue_" not in answer.content


def test_without_a_token_set_no_bearer_gets_in(client, filled):
    answer = client.get("/txqueue/metrics", headers={"Authorization": "Bearer None"})
    assert answer.status_code == 401


@pytest.mark.parametrize("who", ["not staff", "no permission"])
def test_the_view_refuses_a_user_without_staff_and_permission_with_403(client, filled, who):
    staff(client, is_staff=who != "not staff", permission=who != "no permission")
    answer = client.get("/txqueue/metrics")
    assert answer.status_code == 403
    assert b"txqueue_" not in answer.content


def test_the_view_answers_501_without_the_extra(client, filled, monkeypatch):
    staff(client)
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails
    answer = client.get("/txqueue/metrics")
    assert answer.status_code == 501
    assert b"django-txqueue[prometheus]" in answer.content


def test_a_short_token_is_a_system_check_error():
    with override_settings(TXQUEUE={"METRICS_TOKEN": "short"}):
        assert [error.id for error in check_metrics_token()] == ["txqueue.E011"]
    with override_settings(TXQUEUE={"METRICS_TOKEN": TOKEN}):
        assert check_metrics_token() == []
    with override_settings(TXQUEUE={}):
        assert check_metrics_token() == []


# -- without the extra -------------------------------------------------------------------


def test_metrics_port_without_the_extra_names_it(run_consumer, monkeypatch, db):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(CommandError, match=r"pip install 'django-txqueue\[prometheus\]'"):
        run_consumer("echo", "--burst", "--metrics-port", "9")


def test_a_port_in_use_is_a_command_error_naming_it(run_consumer, db):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(CommandError, match=f"--metrics-port {port}: "):
            run_consumer("echo", "--burst", "--metrics-port", str(port), "--skip-checks")
    assert metrics.recorder is None  # nothing enabled


def test_nothing_imports_prometheus_client_unless_asked():
    """A consumer's modules, the URLconf, the view and the checks: none imports it."""
    code = (
        "import sys, django; django.setup();"
        "from django_txqueue import urls, checks;"
        "from django_txqueue.consumer import worker, settle, housekeeping;"
        "from django_txqueue.observe import views;"
        "from django_txqueue.management.commands import run_queue_consumer;"
        "sys.exit('prometheus_client' in sys.modules)"
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "PYTHONPATH": str(ROOT)}
    assert subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT).returncode == 0


# -- the Grafana dashboard ---------------------------------------------------------------


def test_the_grafana_dashboard_uses_only_these_metrics_and_all_of_them():
    board = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    exprs = [
        target["expr"]
        for panel in board["panels"]
        for target in panel.get("targets", [])
        if "expr" in target
    ]
    assert exprs
    used = set()
    for expr in exprs:
        for name in re.findall(r"\b(txqueue_[a-z_]+)", expr):
            base = re.sub(r"(_total|_bucket|_sum|_count)$", "", name)
            assert base in METRICS, f"{name} in {expr!r}"
            if name.endswith("_total"):
                assert base in COUNTERS, name
            if name.endswith(("_bucket", "_sum", "_count")):
                assert base in HISTOGRAMS, name
            used.add(base)
        # Every other word followed by "{" or standing as a selector names nothing else.
        for selector in re.findall(r"([A-Za-z_:][A-Za-z0-9_:]*)\{", expr):
            assert selector.startswith("txqueue_"), f"{selector} in {expr!r}"
    assert used == METRICS


# -- real consumer processes -------------------------------------------------------------


@pytest.fixture
def consumer_processes(tmp_path):
    started = []

    def start(*args):
        err_path = tmp_path / f"consumer{len(started)}.err"
        env = {
            **child_env(),
            "TXQUEUE_TEST_SETTINGS": json.dumps({**FAST, "POLL_INTERVAL": 0.2}),
            "TMPDIR": str(tmp_path),  # where a supervisor makes its multiprocess directory
        }
        with err_path.open("wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "django", "run_queue_consumer", *args],
                env=env,
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=err,
                start_new_session=True,
            )
        proc.err_path = err_path
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def scraped_when(port, proc, condition):
    """Scrape until ``condition(samples)`` holds; the last scrape's text."""
    last = {"text": ""}

    def ready():
        try:
            last["text"] = scrape(port)
        except OSError:
            assert proc.poll() is None, proc.err_path.read_text()
            return False
        return condition(samples(last["text"]))

    if not poll(ready, timeout=START_TIMEOUT, interval=0.2):
        pytest.fail(f"scrape never showed it:\n{last['text']}\n{proc.err_path.read_text()}")
    return last["text"]


@pytest.mark.django_db(transaction=True)
def test_a_consumers_endpoint_after_a_drain(consumer_processes):
    Queue("echo").enqueue_many([{"n": n} for n in range(6)])
    Queue("boom").enqueue({"n": 1}, max_attempts=1)
    Queue("boom").enqueue({"n": 2}, max_attempts=2)
    port = free_port()

    proc = consumer_processes("echo", "boom", "--batch", "2", "--metrics-port", str(port))
    text = scraped_when(
        port,
        proc,
        # A scrape reads the counters before the database: wait for both to settle.
        lambda found: (
            value(found, "txqueue_items", queue="echo", status="done") == 6
            and value(found, "txqueue_items_processed_total", queue="echo") == 6
            and value(found, "txqueue_items", queue="boom", status="failed") == 2
            and value(found, "txqueue_items_failed_total", queue="boom") == 2
        ),
    )

    found = samples(text)
    assert value(found, "txqueue_items_processed_total", queue="echo") == 6
    assert value(found, "txqueue_items_failed_total", queue="boom") == 2
    assert value(found, "txqueue_items_retried_total", queue="boom") == 1
    assert value(found, "txqueue_handler_duration_seconds_count", queue="echo") == 6
    assert value(found, "txqueue_enqueue_to_start_seconds_count", queue="boom") == 3
    assert value(found, "txqueue_claim_batch_size_sum") == 9
    assert value(found, "txqueue_items", queue="echo", status="ready") == 0
    assert value(found, "txqueue_live_consumers", queue="echo") == 1
    assert value(found, "txqueue_paused", queue="echo") == 0
    assert_bounded_labels(text, {"echo", "boom", OUTBOX})
    assert all(name.startswith("txqueue_") for name, _ in found)

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0, proc.err_path.read_text()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_two_processes_are_scraped_as_one(consumer_processes, tmp_path):
    port = free_port()
    proc = consumer_processes("slow", "--processes", "2", "--metrics-port", str(port))
    # Both children up before the items come, so that both take some.
    live = Consumer.objects.filter(stopped_at__isnull=True)
    assert poll(lambda: live.count() == 2, timeout=START_TIMEOUT), proc.err_path.read_text()
    Queue("slow").enqueue_many([{"seconds": 0.05} for _ in range(40)])

    text = scraped_when(
        port, proc, lambda found: value(found, "txqueue_items_processed_total", queue="slow") == 40
    )

    found = samples(text)
    assert value(found, "txqueue_items", queue="slow", status="done") == 40
    assert value(found, "txqueue_handler_duration_seconds_count", queue="slow") == 40
    assert value(found, "txqueue_live_consumers", queue="slow") == 2
    assert_bounded_labels(text, {"slow", OUTBOX})
    # Both children took part: the sum is theirs, not one process's.
    working = Consumer.objects.filter(processed__gt=0, stopped_at__isnull=True)
    assert poll(lambda: working.count() == 2, timeout=10), list(working.values())
    assert list(tmp_path.glob("txqueue-metrics-*/*.db"))  # the children's files

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, proc.err_path.read_text()
    assert not list(tmp_path.glob("txqueue-metrics-*"))  # removed by the supervisor


def test_a_configured_queue_is_scraped_with_zeros_before_its_first_item(client, db, settings):
    settings.TXQUEUE = {"METRICS_TOKEN": TOKEN, "QUEUES": {"emails": {"LEASE": 5}}}
    answer = client.get("/txqueue/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    found = samples(answer.content.decode())
    assert value(found, "txqueue_items", queue="emails", status="ready") == 0
    assert value(found, "txqueue_live_consumers", queue="emails") == 0
