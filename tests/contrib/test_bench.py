"""``manage.py txqueue_bench``: small runs, checked for their report's shape, for
exactly-once verification, and for touching nothing but the bench's own queue."""

import io
import json

import pytest
from django.core.management import CommandError, call_command
from django.db import connection

from django_txqueue import Queue, Status
from django_txqueue.consumer import registry
from django_txqueue.contrib.bench import drain
from django_txqueue.contrib.bench.report import drain_table
from django_txqueue.contrib.target import Target
from django_txqueue.models import Consumer, QueueItem
from tests.helpers import child_env, strategies

SMALL = [
    "--items", "200", "--batch", "1", "10", "--processes", "2",
    "--enqueue-items", "100", "--wakeup-items", "10", "--cold-starts", "1",
    "--idle-seconds", "0", "--scale-rows", "2000", "--scale-claims", "100",
]  # fmt: skip


@pytest.fixture
def consumers_open_this_database(monkeypatch):
    """The drain's run_queue_consumer processes open this test database, as child_env()
    tells a test's child processes."""
    for name, value in child_env().items():
        monkeypatch.setenv(name, value)


def bench(*args):
    """Run the command; return (stdout, stderr, the CommandError or None)."""
    out, err = io.StringIO(), io.StringIO()
    try:
        call_command("txqueue_bench", *args, stdout=out, stderr=err)
    except CommandError as exc:
        return out.getvalue(), err.getvalue(), exc
    return out.getvalue(), err.getvalue(), None


def snapshot(queue):
    rows = QueueItem.objects.filter(queue=queue).order_by("pk")
    return list(rows.values_list("pk", "status", "attempts", "payload"))


def test_refuses_a_database_whose_name_is_not_test_bench_or_staging(monkeypatch):
    # No database access is allowed here: the refusal comes before any query.
    monkeypatch.setitem(connection.settings_dict, "NAME", "production")
    with pytest.raises(CommandError, match=r"'production'.*--yes"):
        call_command("txqueue_bench", "--json")


def test_of_a_database_path_only_the_files_name_counts(monkeypatch):
    # SQLite's NAME is a path: a directory named "tests" makes no test database.
    monkeypatch.setitem(connection.settings_dict, "NAME", "/srv/tests/production.sqlite3")
    with pytest.raises(CommandError, match=r"'production.sqlite3'.*--yes"):
        call_command("txqueue_bench", "--json")


def test_the_process_drain_needs_the_settings_module_by_name(monkeypatch):
    from django.conf import settings

    monkeypatch.setattr(settings, "SETTINGS_MODULE", None)
    monkeypatch.delenv("DJANGO_SETTINGS_MODULE", raising=False)
    with pytest.raises(CommandError, match="DJANGO_SETTINGS_MODULE.*--drain-mode inprocess"):
        call_command("txqueue_bench", "--only", "drain")


def test_rejects_unknown_parts():
    with pytest.raises(CommandError, match="--only takes"):
        call_command("txqueue_bench", "--only", "drain,nap")


@pytest.mark.django_db
def test_the_verifier_reports_an_item_processed_twice():
    queue = Queue("verified")
    queue.enqueue_many([{"n": n} for n in range(3)])
    for item in queue.claim(3, pid="tests:bench"):
        assert item.ack()
    target = Target("default", "verified")
    assert drain.verify_exactly_once(target, 3, 3) == []

    QueueItem.objects.filter(pk=item.pk).update(attempts=2)
    problems = drain.verify_exactly_once(target, 3, 4)
    assert problems == [
        "1 item done after 2 attempts, not done after 1",
        "the consumers processed 4 items, not 3",
    ]
    assert drain.verify_exactly_once(target, 4, 4) == [
        "1 item done after 2 attempts, not done after 1",
        "3 items in the queue where 4 were enqueued",
    ]


@pytest.mark.django_db(transaction=True)
def test_the_fair_part_compares_fair_and_bounded_queues_with_plain_ones():
    out, _, failed = bench(
        "--json", "--only", "fair", "--scale-rows", "2000", "--scale-claims", "100",
        "--enqueue-items", "60",
    )  # fmt: skip
    assert failed is None, out
    report = json.loads(out)["fair"]
    assert [row["backlog"] for row in report["claims"]] == [
        "plain, 10,000 ready",
        "fair, 10,000 ready over 100 keys",
        "plain, 2,000 ready",
        "fair, 2,000 ready over 20 keys",
    ]
    for row in report["claims"]:
        assert row["claimed"] == 100 and row["rate"] > 0
    assert report["claims"][0]["percent_of_plain"] == pytest.approx(100)
    assert [row["what"] for row in report["enqueue"]] == [
        "plain",
        "bounded (MAX_SIZE)",
        "fair (100 per key)",
    ]
    assert all(row["rate"] > 0 for row in report["enqueue"])
    assert not QueueItem.objects.filter(queue="txqueue-bench").exists()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_json_run_of_every_part_verifies_and_spares_other_queues(consumers_open_this_database):
    Queue("real-work").enqueue_many([{"n": n} for n in range(5)])
    finished = Queue("real-work").claim(2, pid="tests:real")
    assert finished[0].ack()
    before = snapshot("real-work")
    consumers = set(Consumer.objects.values_list("pk", flat=True))

    out, err, failed = bench("--json", "--compare-raw", *SMALL)

    assert failed is None, out
    assert err == ""  # no progress with --json
    report = json.loads(out)
    assert report["ok"] is True and report["problems"] == []
    assert report["queue"] == "txqueue-bench"
    assert report["database"]["vendor"] == connection.display_name
    assert [row["what"] for row in report["enqueue"]] == [
        "enqueue(), one per transaction",
        "enqueue_many() of 1,000",
    ]
    for row in report["enqueue"]:
        assert row["ours"] > 0 and row["raw"] > 0 and row["percent"] > 0
        assert row["minimal"] > 0 and row["percent_of_minimal"] > 0
    assert "txqueue_bench_minimal" not in connection.introspection.table_names()  # dropped
    shapes = [(row["strategy"], row["batch"]) for row in report["drain"]]
    assert shapes == [(s, b) for s in strategies()[::-1] for b in (1, 10)]
    for row in report["drain"]:
        assert row["verified"] is True and row["problems"] == []
        assert row["processed"] == 200 and row["processes"] == 2
        assert row["ours"] > 0 and row["raw"] > 0
    wakeup = report["wakeup"]
    assert wakeup["latency"]["n"] == 10 and wakeup["cold_start"]["n"] == 1
    assert wakeup["baseline"]["n"] == 10 and wakeup["claim_statement"]["n"] == 10
    for key in ("latency", "cold_start", "baseline", "claim_statement"):
        stats = wakeup[key]
        assert 0 < stats["p50_ms"] <= stats["p95_ms"] <= stats["max_ms"]
    assert [row["backlog"] for row in report["scale"]] == [
        "10,000 ready",
        "2,000 done + 10,000 ready",
        "2,000 ready",
    ]
    assert report["scale"][0]["percent"] == pytest.approx(100)
    assert all(row["claimed"] == 100 and row["rate"] > 0 for row in report["scale"])

    assert snapshot("real-work") == before
    assert not QueueItem.objects.filter(queue="txqueue-bench").exists()
    assert set(Consumer.objects.values_list("pk", flat=True)) == consumers


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_drain_that_leaves_an_item_unprocessed_fails(monkeypatch):
    def fails_once(item):
        if item.payload == {"n": 7} and item.attempts == 1:
            raise RuntimeError("a handler that fails once")

    monkeypatch.setattr(drain, "handle", fails_once)  # forked consumers inherit it

    out, _, failed = bench(
        "--json", "--only", "drain", "--items", "50", "--batch", "10", "--drain-mode", "inprocess"
    )  # fmt: skip

    assert failed is not None and "verification failed" in str(failed)
    report = json.loads(out)
    assert report["ok"] is False
    assert [row["verified"] for row in report["drain"]] == [False] * len(strategies())
    assert any("1 item ready after 1 attempt" in p for p in report["problems"])
    assert any("processed 49 items, not 50" in p for p in report["problems"])


@pytest.mark.django_db(transaction=True)
def test_the_drain_runs_run_queue_consumer_processes_beside_the_hand_written_loop(
    consumers_open_this_database,
):
    consumers = set(Consumer.objects.values_list("pk", flat=True))

    out, _, failed = bench(
        "--json", "--only", "drain", "--compare-raw", "--items", "200", "--batch", "10",
        "--processes", "2",
    )  # fmt: skip

    assert failed is None, out
    report = json.loads(out)
    assert report["settings"]["drain_mode"] == "process"
    assert [row["strategy"] for row in report["drain"]] == strategies()[::-1]
    for row in report["drain"]:
        assert row["mode"] == "process" and row["verified"] is True, row["problems"]
        assert row["processed"] == 200 and row["processes"] == 2
        assert row["ours"] > 0 and row["raw"] > 0
        assert row["percent_of_first"] == pytest.approx(100)
    assert not QueueItem.objects.filter(queue="txqueue-bench").exists()
    # Their Consumer rows are gone, and this process got no handler for the bench queue.
    assert set(Consumer.objects.values_list("pk", flat=True)) == consumers
    registry.autodiscover()
    assert "txqueue-bench" not in registry.handlers()


def test_several_process_counts_print_side_by_side():
    def row(processes, ours, raw):
        return {
            "strategy": "skip_locked", "batch": 10, "processes": processes, "items": 100,
            "mode": "process", "ours": ours, "raw": raw, "percent": 100 * ours / raw,
            "percent_of_first": 100 * ours / 400, "raw_percent_of_first": 100 * raw / 500,
            "verified": True,
        }  # fmt: skip

    lines = drain_table([row(4, 400, 500), row(16, 360, 550)])

    assert lines[0] == "100 items per drain, ours through run_queue_consumer processes"
    assert lines[1].split() == [
        "drain", "(no-op", "items)", "txqueue", "hand-written", "%", "of", "it", "txqueue",
        "%", "of", "x4", "hand-written", "%", "of", "x4", "exactly", "once",
    ]  # fmt: skip
    assert lines[3].split() == [
        "skip_locked,", "batch", "10,", "x16", "360/s", "550/s", "65%", "90%", "110%", "yes"
    ]  # fmt: skip


@pytest.mark.django_db(transaction=True)
def test_a_table_and_progress_lines_without_json():
    out, err, failed = bench("--only", "enqueue", "--enqueue-items", "50", "--compare-raw")

    assert failed is None
    assert "enqueue(), one per transaction" in out and "% of it" in out
    assert "] enqueue(), one per transaction" in err  # one plain line per step
    assert "\r" not in err
    assert Status.READY not in QueueItem.objects.filter(queue="txqueue-bench").values_list(
        "status", flat=True
    )


def test_help_lists_every_option():
    from django_txqueue.contrib.bench.management.commands.txqueue_bench import Command

    text = Command().create_parser("manage.py", "txqueue_bench").format_help()
    for option in (
        "--compare-raw",
        "--drain-mode",
        "--json",
        "--processes",
        "--scale-rows",
        "--yes",
    ):
        assert option in text
