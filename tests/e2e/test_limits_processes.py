"""Limits (docs/limits.md) with real consumer processes, as a user runs them:
``run_queue_consumer --processes 2 --max-items 100`` drains 1,000 items, every one DONE
once, in children recycled at 100 each; ``--max-memory`` stops a process whose handler leaks
before it grows further; ``MAX_IN_FLIGHT`` and the rate limits hold across processes; a
handler past its queue's ``TIMEOUT`` is stopped, its process replaced."""

import json
import signal
import subprocess
import sys
import time
from collections import defaultdict
from datetime import timedelta

import pytest

from django_txqueue import Queue, Status
from django_txqueue.consumer.timeouts import ITEM_TIMEOUT_EXIT
from django_txqueue.contrib.chaos.verify import most_in_any_stretch
from django_txqueue.models import Consumer, QueueRate
from django_txqueue.store.rates import SHARED
from tests.helpers import ROOT, child_env, child_pids, kill_tree, runs_per_item, wait_for
from tests.testapp.models import Run

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

FAST = {"HEARTBEAT_INTERVAL": 0.2, "POLL_INTERVAL": 0.5, "CONSUMER_TIMEOUT": 5}


def start(tmp_path, *args, settings=None):
    """Start ``run_queue_consumer ARGS -v 2``, logging to a file of its own."""
    log = tmp_path / f"consumer{len(list(tmp_path.glob('*.err')))}.err"
    with log.open("wb") as err:
        process = subprocess.Popen(  # noqa: S603 - our own command line
            [sys.executable, "-m", "django", "run_queue_consumer", *args, "-v", "2"],
            env={**child_env(), "TXQUEUE_TEST_SETTINGS": json.dumps({**FAST, **(settings or {})})},
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )
    process.log = log
    return process


def finish(process, timeout=180):
    """Wait for a started consumer to end: its exit code and its log."""
    try:
        code = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(process)
        pytest.fail(f"still running after {timeout} s:\n{process.log.read_text()}")
    return code, process.log.read_text()


def consume(tmp_path, *args, timeout=180):
    """Run ``run_queue_consumer ARGS -v 2`` to its end: its exit code and its log."""
    return finish(start(tmp_path, *args), timeout)


def test_max_items_under_two_processes_recycles_each_child_at_100_and_runs_each_item_once(
    tmp_path,
):
    Queue("echo").enqueue_many([{"n": n} for n in range(1000)])
    ids = set(Queue("echo").items.values_list("pk", flat=True))

    code, log = consume(
        tmp_path, "echo", "--processes", "2", "--max-items", "100", "--batch", "10", "--burst"
    )

    assert code == 0, log
    done = Queue("echo").items.filter(status=Status.DONE, attempts=1)
    assert set(done.values_list("pk", flat=True)) == ids
    assert runs_per_item() == dict.fromkeys(ids, 1)
    # Each of the two places ends with a child that found the queue empty, having run
    # fewer than 100 items (the last two share what is left, as they happen to run side by
    # side), or none. So 9 or 10 children ran 100 each, and each was replaced.
    recycled = log.count("recycled (max-items: claimed 100 items")
    assert recycled in (9, 10), log
    assert log.count("started consumer process") == recycled + 2, log
    processed = sorted(Consumer.objects.values_list("processed", flat=True), reverse=True)
    assert processed[:recycled] == [100] * recycled
    assert max(processed[recycled:]) < 100 and sum(processed) == 1000


def test_max_memory_stops_a_leaking_consumer_with_nothing_lost(tmp_path):
    Queue("leaky").enqueue_many([{"n": n} for n in range(60)])  # 10 MB leaked per item

    code, log = consume(tmp_path, "leaky", "--max-memory", "250", "--batch", "2", "--burst")

    assert code == 0, log
    assert "recycling (max-memory:" in log, log
    items = Queue("leaky").items
    done = items.filter(status=Status.DONE)
    assert 0 < done.count() < 60
    assert set(done.values_list("attempts", flat=True)) == {1}
    assert set(items.exclude(status=Status.DONE).values_list("status", "attempts")) == {
        (Status.READY, 0)
    }
    assert set(runs_per_item().values()) == {1}


def most_at_once(items):
    """The most of ``items`` held at one moment, from each one's claim to its end, by the
    database's clock."""
    events = sorted(
        [(item.claimed_at, 1) for item in items] + [(item.finished_at, -1) for item in items]
    )
    held = most = 0
    for _, change in events:  # an end before a claim at the same instant
        held += change
        most = max(most, held)
    return most


def test_max_in_flight_holds_across_three_processes(tmp_path):
    Queue("slow").enqueue_many([{"seconds": 0.2} for _ in range(20)])
    capped = {"QUEUES": {"slow": {"MAX_IN_FLIGHT": 2}}}
    procs = [
        start(tmp_path, "slow", "--concurrency", "2", "--burst", settings=capped) for _ in range(3)
    ]
    for process in procs:
        code, log = finish(process)
        assert code == 0, log
    items = list(Queue("slow").items.filter(status=Status.DONE))
    assert len(items) == 20
    assert most_at_once(items) == 2  # never more, and the cap was used


def drain_limited(tmp_path, options, keys=None, count=200):
    """``count`` echo items drained by 4 consumer processes of 4 threads under
    ``options``: the items, DONE."""
    items = [{"n": n} for n in range(count)]
    if keys is None:
        Queue("echo").enqueue_many(items)
    else:
        for key in range(keys):
            Queue("echo").enqueue_many(items[key::keys], key=f"customer-{key}")
    limited = {"QUEUES": {"echo": options}}
    procs = [
        start(tmp_path, "echo", "--concurrency", "4", "--burst", settings=limited)
        for _ in range(4)
    ]
    for process in procs:
        code, log = finish(process)
        assert code == 0, log
    done = list(Queue("echo").items.filter(status=Status.DONE))
    assert len(done) == count
    assert {item.attempts for item in done} == {1}  # nothing charged for waiting
    return done


def test_a_rate_limit_holds_across_four_processes(tmp_path):
    done = drain_limited(tmp_path, {"RATE_LIMIT": "20/s"})
    claimed = [item.claimed_at for item in done]
    assert most_in_any_stretch(claimed, 1.0) == 20  # never more, and the budget was used
    assert max(claimed) - min(claimed) >= timedelta(seconds=9)
    assert max(item.finished_at for item in done) - min(claimed) < timedelta(seconds=20)


def test_a_rate_limit_per_key_holds_across_four_processes(tmp_path):
    done = drain_limited(tmp_path, {"RATE_LIMIT_PER_KEY": "4/s"}, keys=5)
    by_key = defaultdict(list)
    for item in done:
        by_key[item.key].append(item.claimed_at)
    assert len(by_key) == 5
    for claimed in by_key.values():
        assert most_in_any_stretch(claimed, 1.0) == 4
        assert max(claimed) - min(claimed) >= timedelta(seconds=9)
    # The keys ran side by side: 5 keys of 40 items at 4 a second, not one after another.
    everything = [moment for claimed in by_key.values() for moment in claimed]
    assert max(everything) - min(everything) < timedelta(seconds=20)


def test_a_rate_limit_per_key_granted_and_counted_holds_across_four_processes(tmp_path):
    """At "20/s" for 80 items a key, the first claims go under grants of every key's
    budget (store.KeyGrants) and the others count their keys with the grants in: the two
    kinds of claim side by side never take more than 20 of a key in a second."""
    done = drain_limited(tmp_path, {"RATE_LIMIT_PER_KEY": "20/s"}, keys=5, count=400)
    by_key = defaultdict(list)
    for item in done:
        by_key[item.key].append(item.claimed_at)
    assert len(by_key) == 5
    for claimed in by_key.values():
        assert 10 <= most_in_any_stretch(claimed, 1.0) <= 20
        assert max(claimed) - min(claimed) >= timedelta(seconds=3)
    granted = QueueRate.objects.get(queue="echo", per_key=True, key=SHARED)
    assert granted.claims  # some claims went under grants
    counted = QueueRate.objects.filter(queue="echo", per_key=True).exclude(key=SHARED)
    assert counted.exists()  # and some counted their keys


TIMEOUT = 2
# From the handler's TIMEOUT to its item settled: the consumer's loop looks at its running
# handlers every turn (at most 0.2 s apart while it holds any), then one UPDATE.
SETTLED_WITHIN = 1.0


def hung_and_others():
    """One "slow" item that sleeps for an hour, on its last attempt, and 20 quick ones."""
    hung = Queue("slow").enqueue({"seconds": 3600}, max_attempts=1)
    others = Queue("slow").enqueue_many([{"seconds": 0.05} for _ in range(20)])
    return hung, others


def assert_stopped_in_time(hung):
    hung.refresh_from_db()
    assert (hung.status, hung.error_class) == (Status.FAILED, "django_txqueue.ItemTimeout")
    assert f"ran past its TIMEOUT of {TIMEOUT} s" in hung.last_error
    assert "in slow" in hung.last_error  # where its thread was: the handler's sleep
    ran = (hung.finished_at - hung.claimed_at).total_seconds()
    assert TIMEOUT <= ran < TIMEOUT + SETTLED_WITHIN


def test_a_hung_handler_under_two_processes_is_stopped_and_its_process_replaced(tmp_path):
    hung, others = hung_and_others()
    limited = {"SHUTDOWN_TIMEOUT": 5, "QUEUES": {"slow": {"TIMEOUT": TIMEOUT}}}
    supervisor = start(
        tmp_path, "slow", "--processes", "2", "--concurrency", "2", settings=limited
    )
    try:
        assert wait_for(lambda: len(child_pids(supervisor.pid)) == 2, timeout=30)
        first = set(child_pids(supervisor.pid))
        ids = [item.pk for item in others]
        done = Queue("slow").items.filter(pk__in=ids, status=Status.DONE)
        assert wait_for(lambda: done.count() == 20, timeout=60), supervisor.log.read_text()
        assert wait_for(
            lambda: Queue("slow").items.filter(pk=hung.pk, status=Status.FAILED).exists(),
            timeout=30,
        )
        assert_stopped_in_time(hung)
        # The child that ran it exited ITEM_TIMEOUT_EXIT and another took its place.
        assert wait_for(
            lambda: len(now := child_pids(supervisor.pid)) == 2 and set(now) != first,
            timeout=30,
        ), supervisor.log.read_text()
    finally:
        supervisor.send_signal(signal.SIGTERM)
        code, log = finish(supervisor, timeout=60)
    assert code == 0, log
    assert "past its TIMEOUT; starting another" in log, log
    assert set(runs_per_item().values()) == {1}  # every item ran once, the hung one too


@pytest.mark.parametrize("concurrency", ["1", "2"])  # 1: the handler on the loop's thread
def test_a_single_process_with_a_hung_handler_exits_75_with_nothing_lost(tmp_path, concurrency):
    hung, others = hung_and_others()
    limited = {"SHUTDOWN_TIMEOUT": 2, "QUEUES": {"slow": {"TIMEOUT": TIMEOUT}}}
    began = time.monotonic()
    code, log = finish(
        start(tmp_path, "slow", "--concurrency", concurrency, "--burst", settings=limited),
        timeout=60,
    )
    assert code == ITEM_TIMEOUT_EXIT == 75, log
    assert time.monotonic() - began < 30
    assert "ran past its TIMEOUT of 2 s" in log, log
    assert_stopped_in_time(hung)
    rest = Queue("slow").items.filter(pk__in=[item.pk for item in others])
    # Done, or released unstarted without an attempt counted: none left in progress.
    assert set(rest.exclude(status=Status.DONE).values_list("status", "attempts")) <= {
        (Status.READY, 0)
    }
    # Started again (as systemd or Kubernetes would), a consumer finishes them.
    code, log = consume(tmp_path, "slow", "--burst")
    assert code == 0, log
    assert rest.filter(status=Status.DONE).count() == 20
    assert set(runs_per_item().values()) == {1}


# Past SHUTDOWN_TIMEOUT after a SIGTERM, a consumer exits 0 and leaves what still runs for
# the rescue, its handler's thread (the loop's own, at --concurrency 1) still in the handler.
STOPPED_WITHIN = 3.0  # seconds past SHUTDOWN_TIMEOUT: the watchdog's grace and its looks


def stopped_with_one_running(tmp_path, queue, first, concurrency, shutdown_timeout):
    """Start a consumer of ``queue`` holding ``first`` and 3 quick items in one claim,
    SIGTERM it once ``first`` runs: its exit code, log, seconds to exit, and the quick
    items."""
    running = Queue(queue).enqueue(first)
    quick = Queue(queue).enqueue_many([{"rows": 1, "seconds": 0}] * 3)
    proc = start(
        tmp_path, queue, "--concurrency", concurrency, "--batch", "4",
        settings={"SHUTDOWN_TIMEOUT": shutdown_timeout},
    )  # fmt: skip
    ran = Run.objects.filter(item_id=running.pk)
    assert wait_for(ran.exists, timeout=30), finish(proc, timeout=1)
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    code, log = finish(proc, timeout=60)
    return running, quick, code, log, time.monotonic() - sent


def assert_released_or_done(items):
    rows = Queue(items[0].queue).items.filter(pk__in=[item.pk for item in items])
    states = set(rows.values_list("status", "attempts"))
    assert states <= {(Status.DONE, 1), (Status.READY, 0)}, states


@pytest.mark.parametrize("concurrency", ["1", "2"])
def test_sigterm_ends_a_consumer_whose_handler_runs_past_the_shutdown_timeout(
    tmp_path, concurrency
):
    running, quick, code, log, took = stopped_with_one_running(
        tmp_path, "slow", {"seconds": 3600}, concurrency, shutdown_timeout=1
    )
    assert code == 0, log
    assert 1 <= took < 1 + STOPPED_WITHIN, log
    assert "shutdown timeout: 1 item left IN_PROGRESS for rescue" in log, log
    running.refresh_from_db()
    assert running.status == Status.IN_PROGRESS  # the rescue's, once its lease runs out
    assert Consumer.objects.get(identity=running.pid).stopped_at is not None
    assert_released_or_done(quick)


@pytest.mark.parametrize("concurrency", ["1", "2"])
def test_sigterm_reaches_a_consumer_whose_handler_is_in_a_c_call(tmp_path, concurrency):
    """Python's handler for the signal waits for the C call; at --concurrency 1 that is
    the loop's thread, and the watchdog, hearing the signal too, takes it."""
    running, quick, code, log, took = stopped_with_one_running(
        tmp_path, "in-c", {}, concurrency, shutdown_timeout=1
    )
    assert code == 0, log
    assert took < 1 + STOPPED_WITHIN, log
    assert "shutdown timeout: 1 item left IN_PROGRESS for rescue" in log, log
    taken = "signal 15 taken while a handler holds the main thread"
    assert (taken in log) == (concurrency == "1"), log
    assert_released_or_done(quick)


def test_a_signal_taken_by_the_watchdog_is_not_counted_again_once_the_c_call_ends(tmp_path):
    """The watchdog stops the consumer; Python's handler, run once the call returns, does
    not take the same SIGTERM for a second one (which would end the process at once)."""
    # About 5 s of SQLite's C code (2 cores, idle): well past the watchdog's 0.5 s grace.
    rows = 8_000_000
    running, quick, code, log, took = stopped_with_one_running(
        tmp_path, "in-c", {"rows": rows}, "1", shutdown_timeout=60
    )
    assert code == 0, log
    assert "signal 15 taken while a handler holds the main thread" in log, log
    running.refresh_from_db()
    assert (running.status, running.result) == (Status.DONE, rows)  # finished gracefully
    assert_released_or_done(quick)


def test_a_second_signal_ends_a_consumer_in_a_c_call_at_once(tmp_path):
    """Both heard by the watchdog alone (Python's handler waits for the C call): the
    second ends the process as it would any consumer, 128 + SIGTERM."""
    running = Queue("in-c").enqueue({})
    proc = start(tmp_path, "in-c", settings={"SHUTDOWN_TIMEOUT": 60})
    ran = Run.objects.filter(item_id=running.pk)
    assert wait_for(ran.exists, timeout=30), finish(proc, timeout=1)
    proc.send_signal(signal.SIGTERM)
    time.sleep(1.0)  # past the watchdog's grace: the first is taken, the consumer stopping
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    code, log = finish(proc, timeout=30)
    assert code == 128 + signal.SIGTERM, log
    assert time.monotonic() - sent < STOPPED_WITHIN, log
    running.refresh_from_db()
    assert running.status == Status.IN_PROGRESS  # left for the rescue
