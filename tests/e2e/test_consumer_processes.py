"""Real consumer processes: ``python -m django run_queue_consumer`` against the test database.

Each test starts the command as a user would, sends it the signals an operator (or a crash)
would, and checks the database afterwards. Children open the test database through
``child_env()``; ``TXQUEUE_TEST_SETTINGS`` gives them fast heartbeats, rescues and retries.
"""

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from django.utils import timezone

from django_txqueue import Queue, Status, store
from django_txqueue.models import Consumer, QueueItem
from tests import helpers
from tests.helpers import ROOT, child_env, child_pids, finished_items, has, runs_per_item
from tests.testapp.models import Run

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

SHUTDOWN_TIMEOUT = 5
FAST = {
    "HEARTBEAT_INTERVAL": 0.2,
    "RESCUE_INTERVAL": 0.5,
    "CONSUMER_TIMEOUT": 2,
    "POLL_INTERVAL": 0.5,
    "RETRY_DELAY": 0.01,
    "RETRY_MAX_DELAY": 0.01,
    "SHUTDOWN_TIMEOUT": SHUTDOWN_TIMEOUT,
}
START_TIMEOUT = 20  # seconds for a consumer to start (Django setup, migrations checked)


@pytest.fixture
def consumers(tmp_path):
    """Start ``run_queue_consumer ARGS`` processes; whatever is still running is killed after."""
    started = []

    def start(*args, **settings):
        """``settings`` override FAST's for this consumer."""
        err_path = tmp_path / f"consumer{len(started)}.err"
        with (
            (tmp_path / f"consumer{len(started)}.out").open("wb") as out,
            err_path.open("wb") as err,
        ):
            proc = subprocess.Popen(  # noqa: S603 - our own command line
                [sys.executable, "-m", "django", "run_queue_consumer", *args],
                env={**child_env(), "TXQUEUE_TEST_SETTINGS": json.dumps({**FAST, **settings})},
                cwd=ROOT,
                stdout=out,
                stderr=err,
                start_new_session=True,  # its own process group, as in a terminal
            )
        started.append(proc)
        proc.err_path = err_path
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGSTOP)  # a supervisor must not start more children
            for pid in child_pids(proc.pid):
                os.kill(pid, signal.SIGKILL)
            proc.kill()
        proc.wait(timeout=10)


def stderr_of(*procs):
    return "\n".join(f"--- pid {p.pid} stderr:\n{p.err_path.read_text()}" for p in procs)


def wait_for(condition, timeout, what, procs=()):
    """Poll ``condition`` until it returns something truthy (returned), or fail."""
    value = helpers.wait_for(condition, timeout, interval=0.05)
    if not value:
        pytest.fail(f"timed out after {timeout} s waiting for {what}\n{stderr_of(*procs)}")
    return value


def exit_code(proc, timeout):
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"pid {proc.pid} still running after {timeout} s\n{stderr_of(proc)}")


def pid_exists(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def item_ids(queue):
    return set(Queue(queue).items.values_list("pk", flat=True))


def children_of(supervisor):
    """Consumer rows of a supervisor's running children (it has none of its own)."""
    return list(Consumer.objects.exclude(os_pid=supervisor.pid).filter(stopped_at__isnull=True))


def test_two_burst_consumers_process_every_item_exactly_once(consumers):
    Queue("echo").enqueue_many([{"n": n} for n in range(300)])
    ids = item_ids("echo")

    procs = [consumers("echo", "--burst", "--batch", "5") for _ in range(2)]

    for proc in procs:
        assert exit_code(proc, 60) == 0, stderr_of(proc)
    done = QueueItem.objects.filter(queue="echo", status=Status.DONE, attempts=1)
    assert set(done.values_list("pk", flat=True)) == ids
    assert runs_per_item() == dict.fromkeys(ids, 1)
    rows = Consumer.objects.filter(os_pid__in=[p.pid for p in procs])
    assert rows.count() == 2
    assert all(row.stopped_at is not None for row in rows)
    assert sum(row.processed for row in rows) == 300


def test_two_consumers_stop_claiming_a_paused_queue_and_drain_it_after_resume(consumers):
    """Items in flight at the pause finish; none is claimed while it holds (ten of the
    consumers' heartbeats); after resume every item runs once."""
    slow = Queue("slow")
    slow.enqueue_many([{"seconds": 0.05} for _ in range(200)])
    ids = item_ids("slow")
    procs = [consumers("slow", "--batch", "2", "--concurrency", "2") for _ in range(2)]
    wait_for(lambda: slow.count(Status.DONE) >= 20, 30, "the first items done", procs)
    slow.pause()
    wait_for(lambda: not slow.count(Status.IN_PROGRESS), 5, "items in flight to finish", procs)
    held = slow.count(Status.READY)
    time.sleep(FAST["HEARTBEAT_INTERVAL"] * 10)
    assert slow.count(Status.READY) == held > 0
    assert not slow.count(Status.IN_PROGRESS)
    slow.resume()
    wait_for(lambda: slow.count(Status.DONE) == 200, 60, "the rest done after resume", procs)
    assert runs_per_item() == dict.fromkeys(ids, 1)
    assert all(proc.poll() is None for proc in procs), stderr_of(*procs)


def test_a_burst_consumer_of_a_paused_queue_exits_0_at_once(consumers):
    Queue("echo").enqueue_many([{"n": n} for n in range(5)])
    Queue("echo").pause()
    proc = consumers("echo", "--burst")
    assert exit_code(proc, START_TIMEOUT) == 0, stderr_of(proc)
    assert Queue("echo").count(Status.READY) == 5
    assert runs_per_item() == {}


# SIGHUP too: a closed terminal, or a supervisor passing it on.
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_finishes_running_items_releases_the_rest_and_exits_0(consumers, signum):
    Queue("slow").enqueue_many([{"seconds": 0.3}] * 20)
    ids = item_ids("slow")
    proc = consumers("slow", "--concurrency", "2", "--batch", "4")
    wait_for(lambda: Run.objects.count() >= 3, START_TIMEOUT, "three runs", [proc])

    proc.send_signal(signum)

    assert exit_code(proc, SHUTDOWN_TIMEOUT) == 0, stderr_of(proc)
    me = Consumer.objects.get(os_pid=proc.pid)
    assert me.stopped_at is not None
    assert not QueueItem.objects.filter(pid=me.identity, status=Status.IN_PROGRESS).exists()
    runs = runs_per_item()
    assert set(runs.values()) == {1}
    started = set(runs)
    done = QueueItem.objects.filter(status=Status.DONE, attempts=1)
    assert set(done.values_list("pk", flat=True)) == started
    ready = QueueItem.objects.filter(status=Status.READY, attempts=0, pid="")
    assert set(ready.values_list("pk", flat=True)) == ids - started
    assert ids - started, "the consumer was stopped mid-run, with items left"
    assert me.processed == len(started)


def test_items_of_a_killed_consumer_are_rescued_and_finished_by_another(consumers):
    Queue("slow").enqueue_many([{"seconds": 0.3}] * 16)
    ids = item_ids("slow")
    args = ("slow", "--concurrency", "2", "--batch", "4", "--lease", "2")
    first = consumers(*args)
    wait_for(lambda: Run.objects.count() >= 4, START_TIMEOUT, "four runs", [first])
    killed = Consumer.objects.get(os_pid=first.pid)

    first.kill()
    first.wait(timeout=10)
    in_flight = set(
        QueueItem.objects.filter(pid=killed.identity, status=Status.IN_PROGRESS).values_list(
            "pk", flat=True
        )
    )
    assert in_flight, "the consumer was killed with items in flight"

    second = consumers(*args)
    wait_for(
        lambda: Queue("slow").count(status=Status.DONE) == len(ids),
        30,
        "every item DONE",
        [second],
    )
    second.send_signal(signal.SIGTERM)
    assert exit_code(second, SHUTDOWN_TIMEOUT) == 0, stderr_of(second)

    runs = runs_per_item()
    assert set(runs) == ids
    assert {pk for pk, n in runs.items() if n > 1} <= in_flight
    assert max(runs.values()) <= 2
    rescuer = Consumer.objects.get(os_pid=second.pid).identity
    rescued = QueueItem.objects.filter(pk__in=in_flight)
    assert {(i.status, i.attempts, i.pid) for i in rescued} == {(Status.DONE, 2, rescuer)}
    others = QueueItem.objects.exclude(pk__in=in_flight)
    assert set(others.values_list("status", "attempts")) == {(Status.DONE, 1)}
    assert killed.stopped_at is None  # it never got to say goodbye


def test_failing_handler_is_retried_then_failed_with_its_traceback(consumers):
    item = Queue("boom").enqueue({"n": 1}, max_attempts=3)
    deadline = time.monotonic() + 40
    while True:  # --burst exits while the retry is scheduled: run it again, as cron would
        proc = consumers("boom", "--burst")
        assert exit_code(proc, 30) == 0, stderr_of(proc)
        item.refresh_from_db()
        if item.status == Status.FAILED or time.monotonic() > deadline:
            break

    assert item.status == Status.FAILED
    assert item.attempts == 3
    assert "Traceback (most recent call last)" in item.last_error
    assert "ValueError: boom" in item.last_error
    assert sum(Consumer.objects.values_list("failed", flat=True)) == 3


def test_unknown_queue_exits_non_zero_listing_the_known_ones(consumers):
    proc = consumers("no-such-queue", "--burst")

    assert exit_code(proc, 30) != 0
    err = proc.err_path.read_text()
    assert "'no-such-queue'" in err
    assert "Known queues:" in err
    assert "echo" in err and "slow" in err
    assert not Consumer.objects.exists()


def test_supervisor_restarts_a_killed_child_and_stops_all_on_sigterm(consumers):
    Queue("slow").enqueue_many([{"seconds": 0.1}] * 300)
    supervisor = consumers("slow", "--processes", "2")
    first = wait_for(
        lambda: len(rows := children_of(supervisor)) == 2 and rows,
        START_TIMEOUT,
        "two children",
        [supervisor],
    )
    victim = first[0]

    os.kill(victim.os_pid, signal.SIGKILL)

    new = wait_for(
        lambda: (
            Consumer.objects.exclude(os_pid=supervisor.pid)
            .exclude(identity__in=[row.identity for row in first])
            .first()
        ),
        START_TIMEOUT,
        "a new child",
        [supervisor],
    )
    assert new.os_pid != victim.os_pid
    wait_for(
        lambda: QueueItem.objects.filter(pid=new.identity, status=Status.DONE).exists(),
        START_TIMEOUT,
        "the new child to process items",
        [supervisor],
    )

    supervisor.send_signal(signal.SIGTERM)

    assert exit_code(supervisor, SHUTDOWN_TIMEOUT + 5) == 0, stderr_of(supervisor)
    survivors = [first[1].identity, new.identity]
    for row in Consumer.objects.filter(identity__in=survivors):
        assert row.stopped_at is not None, row
        assert not pid_exists(row.os_pid)
    assert not QueueItem.objects.filter(pid__in=survivors, status=Status.IN_PROGRESS).exists()
    assert Consumer.objects.exclude(os_pid=supervisor.pid).count() == 3


def test_ctrl_c_stops_supervised_children_gracefully(consumers):
    """A terminal's Ctrl-C sends SIGINT to the whole foreground process group."""
    Queue("slow").enqueue_many([{"seconds": 0.3}] * 100)
    supervisor = consumers("slow", "--processes", "2", "--concurrency", "2")
    children = wait_for(
        lambda: len(rows := children_of(supervisor)) == 2 and rows,
        START_TIMEOUT,
        "two children",
        [supervisor],
    )
    wait_for(lambda: Run.objects.count() >= 4, START_TIMEOUT, "four runs", [supervisor])

    os.killpg(supervisor.pid, signal.SIGINT)

    assert exit_code(supervisor, SHUTDOWN_TIMEOUT + 5) == 0, stderr_of(supervisor)
    for row in Consumer.objects.filter(pk__in=[row.pk for row in children]):
        assert row.stopped_at is not None, f"{row} was not stopped gracefully"
    assert not QueueItem.objects.filter(status=Status.IN_PROGRESS).exists()


def test_sigterm_while_a_dead_child_waits_to_be_restarted(consumers):
    supervisor = consumers("echo", "--processes", "2")
    children = wait_for(
        lambda: len(rows := children_of(supervisor)) == 2 and rows,
        START_TIMEOUT,
        "two children",
        [supervisor],
    )
    os.kill(children[0].os_pid, signal.SIGKILL)
    # Reaped: the supervisor saw it die and now pauses (1 s for a young death) to restart it.
    wait_for(lambda: not pid_exists(children[0].os_pid), 5, "the supervisor to reap it")

    supervisor.send_signal(signal.SIGTERM)

    assert exit_code(supervisor, SHUTDOWN_TIMEOUT + 5) == 0, stderr_of(supervisor)
    assert Consumer.objects.exclude(os_pid=supervisor.pid).count() == 2, "nothing restarted"
    assert Consumer.objects.get(pk=children[1].pk).stopped_at is not None


def test_a_second_sigterm_stops_at_once_leaving_items_for_rescue(consumers, settings):
    settings.TXQUEUE = {**settings.TXQUEUE, "CONSUMER_TIMEOUT": FAST["CONSUMER_TIMEOUT"]}
    Queue("slow").enqueue_many([{"seconds": 30}] * 2)
    proc = consumers("slow", "--concurrency", "2")
    wait_for(lambda: Run.objects.count() == 2, START_TIMEOUT, "two running handlers", [proc])

    proc.send_signal(signal.SIGTERM)  # graceful: would wait up to SHUTDOWN_TIMEOUT
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)  # at once

    assert exit_code(proc, 2) == 128 + signal.SIGTERM
    me = Consumer.objects.get(os_pid=proc.pid)
    held = QueueItem.objects.filter(pid=me.identity, status=Status.IN_PROGRESS)
    assert held.count() == 2  # not acknowledged, not released: stuck once it is silent
    wait_for(lambda: Queue("slow").items.stuck().count() == 2, 10, "the items to become stuck")


def test_shutdown_timeout_holds_with_one_handler_thread(consumers):
    """--concurrency 1 too: a handler past --shutdown-timeout is left for rescue, exit 0."""
    item = Queue("slow").enqueue({"seconds": 60})
    proc = consumers("slow", "--concurrency", "1", "--shutdown-timeout", "1")
    wait_for(lambda: Run.objects.exists(), START_TIMEOUT, "the run", [proc])

    proc.send_signal(signal.SIGTERM)
    started = time.monotonic()
    assert exit_code(proc, 10) == 0, stderr_of(proc)
    assert time.monotonic() - started < 4

    me = Consumer.objects.get(os_pid=proc.pid)
    assert me.stopped_at is not None
    stored = QueueItem.objects.get(pk=item.pk)
    assert (stored.status, stored.pid) == (Status.IN_PROGRESS, me.identity)
    assert Queue("slow").items.stuck().filter(pk=item.pk).exists()  # the next rescue takes it


def test_a_handler_calling_sys_exit_fails_its_item_and_burst_exits_0(consumers):
    poison = Queue("exits").enqueue({}, max_attempts=2)
    for _ in range(2):  # an attempt each (the retry may not be due when --burst looks)
        proc = consumers("exits", "--burst")
        assert exit_code(proc, START_TIMEOUT + 10) == 0, stderr_of(proc)
        time.sleep(0.05)
    stored = QueueItem.objects.get(pk=poison.pk)
    assert (stored.status, stored.attempts, stored.error_class) == (
        Status.FAILED,
        2,
        "builtins.SystemExit",
    )


def test_an_orphaned_item_is_rescued_within_lease_plus_rescue_interval(consumers):
    """The promise: READY again (or re-claimed) within LEASE + RESCUE_INTERVAL + 1 s of the
    consumer's death, while another consumer of the queue runs; never while the lease is
    still being renewed."""
    lease = 2.0
    # Heartbeats rarer than the rescue interval and than the keeper's lease: rescues and
    # renewals must keep their own time.
    timing = {"HEARTBEAT_INTERVAL": 3, "RESCUE_INTERVAL": 1, "CONSUMER_TIMEOUT": 60}
    item = Queue("slow").enqueue({"seconds": 30})
    victim = consumers("slow", "--lease", str(lease), **timing)
    wait_for(lambda: Run.objects.exists(), START_TIMEOUT, "the run", [victim])
    # A live consumer with a 1 s lease and a 3 s handler: renewed, so never rescued.
    busy = Queue("slow").enqueue({"seconds": 3})
    keeper = consumers("slow", "--lease", "1", **timing)
    rescuer_pid = keeper.pid
    wait_for(
        lambda: Run.objects.filter(item_id=busy.pk).exists(), START_TIMEOUT, "busy runs", [keeper]
    )
    claimed_by = QueueItem.objects.get(pk=item.pk).pid

    victim.kill()
    killed_at = time.monotonic()
    victim.wait(timeout=10)

    def released():
        stored = QueueItem.objects.get(pk=item.pk)
        return stored.pid != claimed_by

    wait_for(released, lease + timing["RESCUE_INTERVAL"] + 5, "the rescue", [keeper])
    elapsed = time.monotonic() - killed_at
    # The last renewal was at most a third of the lease before the kill; the sweep at
    # most one RESCUE_INTERVAL after the lease ran out.
    assert lease * 2 / 3 - 0.3 <= elapsed
    assert elapsed <= lease + timing["RESCUE_INTERVAL"] + 1
    wait_for(
        lambda: QueueItem.objects.get(pk=busy.pk).status == Status.DONE, 10, "busy done", [keeper]
    )
    done = QueueItem.objects.get(pk=busy.pk)
    keeper_identity = Consumer.objects.get(os_pid=rescuer_pid).identity
    assert (done.attempts, done.pid) == (1, keeper_identity)
    assert runs_per_item()[busy.pk] == 1


def test_an_atomic_handlers_effect_happens_once_though_consumers_are_killed(consumers):
    """@handler("atomic", atomic=True) writes a Run row in the transaction of its
    acknowledgement. Consumers are SIGKILLed mid-handler and replaced; the items they
    held are rescued and run again, yet each item has exactly one Run row."""
    Queue("atomic").enqueue_many([{"seconds": 0.03}] * 120)
    ids = item_ids("atomic")
    args = ("atomic", "--concurrency", "2", "--batch", "2", "--lease", "1")
    procs = [consumers(*args) for _ in range(2)]
    for kill in range(4):
        target = Run.objects.count() + 6
        wait_for(lambda n=target: Run.objects.count() >= n, START_TIMEOUT, "progress", procs)
        victim = procs[kill % 2]
        victim.kill()
        victim.wait(timeout=10)
        procs[kill % 2] = consumers(*args)
    wait_for(lambda: Queue("atomic").count(Status.DONE) == len(ids), 60, "every item DONE", procs)
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    assert [exit_code(proc, SHUTDOWN_TIMEOUT) for proc in procs] == [0, 0], stderr_of(*procs)

    assert runs_per_item() == dict.fromkeys(ids, 1)
    rerun = QueueItem.objects.filter(pk__in=ids, attempts__gt=1)
    assert rerun.exists(), "no item was held by a killed consumer"


def test_a_stopped_consumers_late_atomic_write_is_rolled_back(consumers, tmp_path):
    """A consumer hangs (SIGSTOP) in an atomic handler after writing its effect; its
    lease runs out and another consumer rescues and finishes the item. Resumed, the
    stale handler's acknowledgement is refused and its write rolled back. (On SQLite
    the stale transaction holds the only write lock, so nobody can take the item over
    meanwhile: there the stale consumer finishes it, and the effect is still single.)"""
    entered = tmp_path / "entered"
    item = Queue("atomic").enqueue({"entered": str(entered), "seconds": 1})
    stale = consumers("atomic", "--lease", "1")
    wait_for(entered.exists, START_TIMEOUT, "the handler to start", [stale])
    os.kill(stale.pid, signal.SIGSTOP)  # hung: no heartbeat, no lease renewal, no commit
    stale_identity = Consumer.objects.get(os_pid=stale.pid).identity
    rescuer = consumers("atomic", "--lease", "1")
    # Without row locks (SQLite) the stale transaction holds the database's only write lock.
    single_writer = not has("row_locks")
    if single_writer:
        time.sleep(3)  # the rescuer waits for the write lock all along
    else:
        wait_for(
            lambda: QueueItem.objects.get(pk=item.pk).status == Status.DONE,
            START_TIMEOUT,
            "the rescuer to finish the item",
            [rescuer],
        )
    os.kill(stale.pid, signal.SIGCONT)
    if single_writer:
        wait_for(
            lambda: QueueItem.objects.get(pk=item.pk).status == Status.DONE,
            10,
            "the stale consumer to finish the item",
            [stale],
        )
    else:
        wait_for(
            lambda: "taken over" in stale.err_path.read_text(),
            10,
            "the stale acknowledgement",
            [stale],
        )
    for proc in (stale, rescuer):
        proc.send_signal(signal.SIGTERM)
    assert [exit_code(p, SHUTDOWN_TIMEOUT) for p in (stale, rescuer)] == [0, 0], stderr_of(
        stale, rescuer
    )

    item.refresh_from_db()
    assert item.status == Status.DONE
    assert list(Run.objects.filter(item_id=item.pk).values_list("consumer", flat=True)) == [
        item.pid  # one effect, by the claim whose acknowledgement was accepted
    ]
    if single_writer:
        assert (item.pid, item.attempts) == (stale_identity, 1)
    else:
        rescuer_identity = Consumer.objects.get(os_pid=rescuer.pid).identity
        assert (item.pid, item.attempts) == (rescuer_identity, 2)


# -- RETENTION: consumers purge finished items on a timer of their own --------------------

OLD = dt.timedelta(days=10)
PURGING = {"RETENTION": 3600, "PURGE_INTERVAL": 0.5, "QUEUES": {"noop": {"RETENTION": None}}}


def test_a_consumer_purges_the_finished_items_of_its_queues_past_their_retention(consumers):
    old = finished_items("echo", 2, ago=OLD) | finished_items("echo", ago=OLD, failed=True)
    kept = (
        finished_items("echo", ago=dt.timedelta(minutes=10))
        | finished_items("noop", ago=OLD)  # its queue's RETENTION is None
        | finished_items("slow", ago=OLD)  # a queue the consumer does not serve
    )
    waiting = Queue("echo").enqueue({}, delay=3600)  # READY, not due
    Queue("echo").enqueue({})
    [running] = Queue("echo").claim(1, pid="tests:holder")  # IN_PROGRESS, leased 300 s
    QueueItem.objects.filter(pk__in=[waiting.pk, running.pk]).update(
        finished_at=timezone.now() - OLD  # must not matter
    )
    kept |= {waiting.pk, running.pk}

    proc = consumers("echo", "noop", **PURGING)

    wait_for(lambda: not QueueItem.objects.filter(pk__in=old).exists(), START_TIMEOUT, "a purge")
    later = finished_items("echo", ago=OLD)  # the next purge comes on the timer
    wait_for(lambda: not QueueItem.objects.filter(pk__in=later).exists(), 10, "a second purge")
    assert set(QueueItem.objects.filter(pk__in=kept).values_list("pk", flat=True)) == kept
    assert QueueItem.objects.get(pk=running.pk).status == Status.IN_PROGRESS
    assert QueueItem.objects.get(pk=waiting.pk).status == Status.READY
    proc.send_signal(signal.SIGTERM)
    assert exit_code(proc, SHUTDOWN_TIMEOUT) == 0, stderr_of(proc)
    assert "purge failed" not in proc.err_path.read_text()


def test_with_retention_none_consumers_purge_nothing(consumers):
    old = finished_items("echo", 3, ago=OLD)
    proc = consumers("echo", RETENTION=None, PURGE_INTERVAL=0.2)
    wait_for(lambda: Consumer.objects.filter(os_pid=proc.pid).exists(), START_TIMEOUT, "a start")
    time.sleep(2)  # ten purge intervals
    Queue("echo").enqueue({})
    # The handler's Run row commits before the acknowledgement: wait for the item itself.
    wait_for(lambda: Queue("echo").count(status=Status.DONE) == 4, 10, "the new item", [proc])

    assert Run.objects.count() == 1
    assert old <= item_ids("echo")
    proc.send_signal(signal.SIGTERM)
    assert exit_code(proc, SHUTDOWN_TIMEOUT) == 0, stderr_of(proc)


def test_consumers_purge_one_at_a_time(consumers):
    """While the purge lock is held (here by the test's connection), no consumer purges;
    once it is free, one of the two does, and neither fails."""
    old = finished_items("echo", 5, ago=OLD)
    # Committed first: on PostgreSQL the lock is a transaction's, which the block holds open.
    Queue("echo").enqueue_many([{}] * 2)
    with store.try_lock("default", store.PURGE_LOCK) as held:
        assert held
        procs = [consumers("echo", **PURGING) for _ in range(2)]
        wait_for(lambda: Run.objects.count() == 2, START_TIMEOUT, "two runs", procs)
        wait_for(lambda: Consumer.objects.count() == 2, START_TIMEOUT, "two consumers", procs)
        time.sleep(1.5)  # three purge intervals
        assert old <= item_ids("echo")

    wait_for(lambda: not (old & item_ids("echo")), 10, "a purge", procs)
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        assert exit_code(proc, SHUTDOWN_TIMEOUT) == 0, stderr_of(proc)
        assert "purge failed" not in proc.err_path.read_text(), stderr_of(proc)
