"""django_txqueue.consumer.housekeeping and its jobs (heartbeat, rescue, purge): the Consumer
row and heartbeat, the renewal of its items' leases, the rescue of dead consumers' items and
of its own lost claims, and the purge of finished items; then the thread under a running
Worker.

Real consumer processes rescuing and purging are in tests/e2e/test_consumer_processes.py.
"""

import datetime as dt
import logging
import os
import threading
import time

import pytest
from django.db import DatabaseError, connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_txqueue import Queue, Status, store
from django_txqueue.consumer.housekeeping import Housekeeping
from django_txqueue.consumer.purge import CONSUMERS_KEPT
from django_txqueue.consumer.rescue import LOST_CLAIM_AGE
from django_txqueue.models import Consumer, Effect, QueueItem
from tests.helpers import finished_items, in_other_thread, running, wait_for, worker_for
from tests.testapp.models import Run

OLD = dt.timedelta(days=10)


def housekeeping(
    *queues, held=list, counters=lambda: (0, 0), lease=None, on_database_error=lambda: None
):
    """The housekeeping thread of a consumer of ``queues`` (not started), holding ``held()``
    ((item, monotonic time its handler started or None) pairs)."""
    return Housekeeping(
        Consumer(identity=store.new_identity(), host="test", os_pid=os.getpid(), queues=[*queues]),
        "default",
        queues=lambda: [Queue(name) for name in queues],
        held=held,
        lease=lease,
        counters=counters,
        stopping=threading.Event(),
        on_database_error=on_database_error,
    )


def row(thread):
    return Consumer.objects.get(pk=thread.consumer.pk)


def lease_left(item):
    """Seconds until ``item``'s lease runs out (database clock, as the lease was set)."""
    stored = QueueItem.objects.get(pk=item.pk)
    return (stored.lease_expires_at - timezone.now()).total_seconds()


@pytest.mark.django_db(transaction=True)
class TestConsumerRow:
    def test_start_registers_the_row_once_and_stop_marks_it_stopped_with_the_counts(self):
        thread = housekeeping("a", "b", counters=lambda: (7, 2))
        thread.stopping.set()  # the thread ends at once: only the row is under test here
        thread.start()
        thread.start()  # started already: no second row, no second thread
        [registered] = Consumer.objects.all()
        assert (registered.identity, registered.queues) == (thread.consumer.identity, ["a", "b"])
        assert registered.stopped_at is None
        assert Consumer.objects.alive().filter(pk=registered.pk).exists()
        thread.stop()
        stopped = row(thread)
        assert stopped.stopped_at is not None and (stopped.processed, stopped.failed) == (7, 2)
        assert not Consumer.objects.alive().exists()

    def test_a_thread_never_started_writes_nothing_when_stopped(self):
        housekeeping("a").stop()
        assert not Consumer.objects.exists()

    def test_each_heartbeat_writes_the_counts_and_the_queues_served_now(self, settings):
        settings.TXQUEUE = {**settings.TXQUEUE, "HEARTBEAT_INTERVAL": 0.05}
        counts, names = [0, 0], ["a"]
        thread = Housekeeping(
            Consumer(identity=store.new_identity(), host="test", os_pid=os.getpid()),
            "default",
            queues=lambda: [Queue(name) for name in names],
            held=list,
            lease=None,
            counters=lambda: tuple(counts),
            stopping=threading.Event(),
            on_database_error=lambda: None,
        )
        thread.start()
        try:
            first = row(thread).last_heartbeat_at
            counts[:] = [3, 1]
            names.append("found-later")  # a queue it found since it started
            assert wait_for(
                lambda: (
                    (
                        (beaten := row(thread)).processed,
                        beaten.failed,
                        beaten.queues,
                    )
                    == (3, 1, ["a", "found-later"])
                )
            )
            assert wait_for(lambda: row(thread).last_heartbeat_at > first)
        finally:
            thread.stopping.set()
            thread.stop()
        assert row(thread).stopped_at is not None

    def test_a_failed_heartbeat_is_reported_and_tried_again_soon(
        self, settings, monkeypatch, caplog
    ):
        """The next heartbeat is a minute away; only the retry after RETRY_PAUSE (0.5 s)
        can write the counts within seconds."""
        settings.TXQUEUE = {**settings.TXQUEUE, "HEARTBEAT_INTERVAL": 60}
        beat, failures = store.beat, []

        def flaky_beat(consumer, **counts):
            if len(failures) < 2:
                failures.append(1)
                raise DatabaseError("server closed the connection unexpectedly")
            beat(consumer, **counts)

        monkeypatch.setattr(store, "beat", flaky_beat)
        errors = []
        thread = housekeeping(
            "a", counters=lambda: (5, 0), on_database_error=lambda: errors.append(1)
        )
        with caplog.at_level(logging.WARNING, logger="django_txqueue.consumer.housekeeping"):
            thread.start()
            try:
                assert wait_for(lambda: row(thread).processed == 5, timeout=5)
            finally:
                thread.stopping.set()
                thread.stop()
        assert errors == [1, 1]  # each failure reported, for the connection to be checked
        assert caplog.text.count("heartbeat failed, will retry") == 2
        assert "server closed the connection unexpectedly" in caplog.text


class TestTick:
    def test_the_heartbeat_interval_or_a_third_of_the_shortest_lease(self, settings):
        settings.TXQUEUE = {
            "HEARTBEAT_INTERVAL": 10,
            "LEASE": 60,
            "QUEUES": {"short": {"LEASE": 3}},
        }
        assert housekeeping("a")._tick() == 10
        assert housekeeping("a", "short")._tick() == pytest.approx(1.0)
        # A consumer's own --lease stands for every queue's.
        assert housekeeping("a", "short", lease=0.6)._tick() == pytest.approx(0.2)
        assert housekeeping()._tick() == 10


class TestLeaseRenewal:
    def test_held_items_get_their_lease_again_those_past_their_timeout_do_not(self, db, settings):
        settings.TXQUEUE = {**settings.TXQUEUE, "QUEUES": {"a": {"TIMEOUT": 2}}}
        Queue("a").enqueue_many([{}] * 4)
        running_now, hung, waiting, not_held = Queue("a").claim(4, pid="me", lease=5)
        started = time.monotonic()
        thread = housekeeping(
            "a",
            lease=600,
            # A handler thread took running_now just now and hung 5 s ago (TIMEOUT 2);
            # waiting was claimed ahead and no handler has started it yet.
            held=lambda: [(running_now, started), (hung, started - 5), (waiting, None)],
        )
        thread._renew_leases()
        assert lease_left(running_now) > 500 and lease_left(waiting) > 500
        assert lease_left(hung) < 10  # left to lapse, so that a rescue can take it back
        assert lease_left(not_held) < 10

    def test_without_a_consumer_lease_each_queue_gets_its_own(self, db, settings):
        settings.TXQUEUE = {**settings.TXQUEUE, "LEASE": 60, "QUEUES": {"long": {"LEASE": 3600}}}
        Queue("a").enqueue({})
        Queue("long").enqueue({})
        [short] = Queue("a").claim(pid="me", lease=1)
        [long] = Queue("long").claim(pid="me", lease=1)
        housekeeping("a", "long", held=lambda: [(short, None), (long, None)])._renew_leases()
        assert 30 < lease_left(short) <= 61
        assert 3000 < lease_left(long) <= 3601

    def test_a_stale_copy_of_a_claim_renews_nothing(self, db):
        """The item was rescued and claimed again: the old claim's token no longer holds it."""
        Queue("a").enqueue({})
        [stale] = Queue("a").claim(pid="me", lease=1)
        QueueItem.objects.filter(pk=stale.pk).update(lease_expires_at=timezone.now())
        assert Queue("a").requeue_stuck() == 1
        [current] = Queue("a").claim(pid="other", lease=5)
        housekeeping("a", lease=600, held=lambda: [(stale, None)])._renew_leases()
        assert lease_left(current) < 10


class TestRescue:
    def test_the_stuck_items_of_its_queues_go_back_to_ready(self, db, caplog):
        Consumer.objects.create(identity="gone", host="h", os_pid=1, stopped_at=timezone.now())
        Queue("a").enqueue_many([{}] * 2)
        Queue("other").enqueue({})
        Queue("a").claim(2, pid="gone", lease=600)
        [not_ours] = Queue("other").claim(pid="gone", lease=600)
        with caplog.at_level(logging.WARNING, logger="django_txqueue.consumer.housekeeping"):
            housekeeping("a")._rescue()
        assert "rescued 2 stuck items" in caplog.text
        assert Queue("a").count(status=Status.READY) == 2
        # Another queue's items wait for a consumer of that queue.
        assert QueueItem.objects.get(pk=not_ours.pk).status == Status.IN_PROGRESS

    def test_many_queues_cost_one_look_and_an_update_per_queue_with_stuck_items(self, db):
        Consumer.objects.create(identity="gone", host="h", os_pid=1, stopped_at=timezone.now())
        names = [f"q{n}" for n in range(20)]
        for name in names:
            Queue(name).enqueue({})
        Queue("q7").claim(pid="gone", lease=600)
        Queue("q12").claim(pid="alive", lease=600)  # no Consumer row: stuck once expired
        with CaptureQueriesContext(connection) as queries:
            housekeeping(*names)._rescue()
        updates = [q["sql"] for q in queries if q["sql"].lstrip().upper().startswith("UPDATE")]
        # q7's rescue, and the release of this consumer's lost claims (a statement each turn).
        assert len(updates) == 2, updates
        assert Queue("q7").count(status=Status.READY) == 1
        assert Queue("q12").count(status=Status.IN_PROGRESS) == 1

    def test_its_own_claims_whose_answer_was_lost_are_released(self, db, caplog):
        """Claims of its identity it does not hold, older than LOST_CLAIM_AGE: the server
        committed them, the answer never came back. Held and recent claims stay."""
        thread = housekeeping("a")
        store.register(thread.consumer, "default")  # alive: its items are not stuck
        Queue("a").enqueue_many([{}] * 3)
        lost, held, recent = Queue("a").claim(3, pid=thread.consumer.identity, lease=600)
        thread.held = lambda: [(held, None)]
        QueueItem.objects.filter(pk__in=[lost.pk, held.pk]).update(
            claimed_at=timezone.now() - LOST_CLAIM_AGE - dt.timedelta(seconds=5)
        )
        with caplog.at_level(logging.WARNING, logger="django_txqueue.consumer.housekeeping"):
            thread._rescue()
        assert "released 1 item claimed by a claim whose answer was lost" in caplog.text
        statuses = dict(QueueItem.objects.values_list("pk", "status"))
        assert statuses == {
            lost.pk: Status.READY,
            held.pk: Status.IN_PROGRESS,
            recent.pk: Status.IN_PROGRESS,
        }
        assert QueueItem.objects.get(pk=lost.pk).attempts == 0  # that attempt never began


def finished(queue, status=Status.DONE, ago=OLD, n=1):
    return finished_items(queue, n, ago=ago, failed=status == Status.FAILED)


def remaining():
    return set(QueueItem.objects.values_list("pk", flat=True))


class TestPurge:
    """Every PURGE_INTERVAL, under a lock only one consumer of the database holds."""

    @pytest.fixture
    def items(self, db, settings):
        settings.TXQUEUE = {"RETENTION": 86400, "QUEUES": {"keep": {"RETENTION": None}}}
        old = finished("a") | finished("a", Status.FAILED) | finished("b", n=3)
        kept = finished("a", ago=dt.timedelta(hours=1)) | finished("keep") | finished("other")
        Queue("a").enqueue_many([{}] * 2)
        running, ready = Queue("a").items.filter(status=Status.READY).order_by("pk")
        Queue("a").claim(1)  # running: IN_PROGRESS
        Queue("a").items.filter(pk__in=[running.pk, ready.pk]).update(
            finished_at=timezone.now() - OLD  # must not matter
        )
        return {"old": old, "kept": kept | {running.pk, ready.pk}}

    def test_old_finished_items_of_its_queues_each_with_its_retention(self, items):
        assert housekeeping("a", "b", "keep")._purge(until=time.monotonic() + 60) is True
        assert remaining() == items["kept"]
        assert Queue("a").count(status=Status.IN_PROGRESS) == 1
        assert Queue("a").count(status=Status.READY) == 1

    def test_queues_kept_alike_are_purged_together(self, items, settings):
        queues = {"keep": {"RETENTION": None}, "short": {"RETENTION": 60}}
        settings.TXQUEUE = {"RETENTION": 86400, "QUEUES": queues}
        short_old = finished("short", ago=dt.timedelta(minutes=5))
        with CaptureQueriesContext(connection) as queries:
            housekeeping("a", "b", "keep", "short")._purge(until=time.monotonic() + 60)
        deletes = [q["sql"] for q in queries if q["sql"].lstrip().upper().startswith("DELETE")]
        assert len(deletes) == 2, deletes  # "a" and "b" in one, "short" in another
        assert remaining() == items["kept"]
        assert not short_old & remaining()

    def test_in_batches(self, items, monkeypatch):
        monkeypatch.setattr(store.upkeep, "PURGE_BATCH", 2)
        housekeeping("a", "b", "keep")._purge(until=time.monotonic() + 60)
        assert remaining() == items["kept"]

    def test_rows_of_consumers_silent_for_a_day_go_unless_they_hold_items(self, items, caplog):
        """Each --burst run leaves a stopped row: a cron job's would pile up in the admin."""
        silent = timezone.now() - CONSUMERS_KEPT - dt.timedelta(minutes=1)

        def consumer(name, heartbeat, **fields):
            row = Consumer.objects.create(identity=name, host="h", os_pid=1, **fields)
            Consumer.objects.filter(pk=row.pk).update(last_heartbeat_at=heartbeat)

        consumer("burst", silent, stopped_at=silent)  # a --burst run, a day ago
        consumer("killed", silent)  # never marked stopped
        consumer("holding", silent)  # its item is stuck: the rescue needs its row
        Queue("a").items.filter(status=Status.IN_PROGRESS).update(pid="holding")
        consumer("recent", timezone.now() - dt.timedelta(hours=1), stopped_at=timezone.now())
        consumer("live", timezone.now())
        with caplog.at_level(logging.INFO, logger="django_txqueue.consumer.purge"):
            housekeeping("a", "b", "keep")._purge(until=time.monotonic() + 60)
        left = set(Consumer.objects.values_list("identity", flat=True))
        assert left == {"holding", "recent", "live"}
        assert "and 2 stopped consumers' rows" in caplog.text
        assert remaining() == items["kept"]

    def test_retention_none_purges_nothing(self, items, settings):
        settings.TXQUEUE = {"RETENTION": None}
        Effect.objects.create(key="old")
        Effect.objects.update(recorded_at=timezone.now() - OLD)
        gone = Consumer.objects.create(identity="gone", host="h", os_pid=1)
        Consumer.objects.filter(pk=gone.pk).update(last_heartbeat_at=timezone.now() - OLD)
        housekeeping("a", "b", "keep")._purge(until=time.monotonic() + 60)
        assert remaining() == items["old"] | items["kept"]
        assert Effect.objects.count() == 1
        assert Consumer.objects.filter(pk=gone.pk).exists()

    def test_retention_none_takes_no_lock(self, items, settings, monkeypatch):
        """Nothing to purge, nothing to lock: behind a transaction pool a lock taken for
        nothing is one more chance to go wrong."""
        settings.TXQUEUE = {"RETENTION": None}
        locked = []
        monkeypatch.setattr(store, "try_lock", lambda *args: locked.append(args))
        assert housekeeping("a", "b")._purge(until=time.monotonic() + 60) is True
        assert locked == []

    def test_not_while_another_connection_holds_the_lock(self, items):
        holding, release = threading.Event(), threading.Event()

        def hold():
            with store.try_lock("default", store.PURGE_LOCK) as held:
                holding.set()
                release.wait(30)
                return held

        thread = threading.Thread(target=in_other_thread, args=(hold,))
        thread.start()
        try:
            assert holding.wait(30)
            assert housekeeping("a", "b")._purge(until=time.monotonic() + 60) is True
            assert remaining() == items["old"] | items["kept"]
        finally:
            release.set()
            thread.join(30)
        housekeeping("a", "b")._purge(until=time.monotonic() + 60)
        assert remaining() == items["kept"]

    def test_cut_short_at_the_deadline_after_one_batch(self, items, monkeypatch):
        monkeypatch.setattr(store.upkeep, "PURGE_BATCH", 1)
        assert housekeeping("a", "b")._purge(until=time.monotonic() - 1) is False
        left = remaining() - items["kept"]
        assert left < items["old"] and len(left) == len(items["old"]) - 1

    def test_once_records_older_than_the_longest_retention(self, db, settings):
        settings.TXQUEUE = {"RETENTION": 3600, "QUEUES": {"long": {"RETENTION": 86400}}}
        for key, ago in (("old", OLD), ("day", dt.timedelta(hours=12)), ("new", dt.timedelta(0))):
            Effect.objects.create(key=key)
            Effect.objects.filter(key=key).update(recorded_at=timezone.now() - ago)
        housekeeping("a")._purge(until=time.monotonic() + 60)
        assert set(Effect.objects.values_list("key", flat=True)) == {"day", "new"}

    def test_an_error_is_logged_and_reported(self, items, monkeypatch, caplog):
        def broken(*args, **kwargs):
            raise DatabaseError("disk full")

        monkeypatch.setattr(store, "purge", broken)
        errors = []
        assert housekeeping("a", on_database_error=lambda: errors.append(1))._purge_safely(
            until=time.monotonic() + 60
        )
        assert "purge failed" in caplog.text and "disk full" in caplog.text
        assert errors == [1]


@pytest.mark.django_db(transaction=True)
def test_a_purge_cut_short_goes_on_after_the_next_heartbeat(settings, monkeypatch):
    """One batch of one item per run (PURGE_RUN 0): the whole backlog goes, one run per
    heartbeat, long before the next PURGE_INTERVAL."""
    settings.TXQUEUE = {"HEARTBEAT_INTERVAL": 0.05, "PURGE_INTERVAL": 3600, "RETENTION": 60}
    monkeypatch.setattr(store.upkeep, "PURGE_BATCH", 1)
    monkeypatch.setattr("django_txqueue.consumer.housekeeping.PURGE_RUN", 0)
    old = finished("a", n=5)
    kept = finished("a", ago=dt.timedelta(0))
    thread = housekeeping("a")
    thread.start()
    try:
        assert wait_for(lambda: remaining() == kept, timeout=20)
    finally:
        thread.stopping.set()
        thread.stop()
    assert not old & remaining()


@pytest.mark.django_db(transaction=True)
def test_the_liveness_thread_goes_on_heartbeating_after_a_purge_error(settings, monkeypatch):
    settings.TXQUEUE = {"HEARTBEAT_INTERVAL": 0.1, "PURGE_INTERVAL": 0.1}
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise ValueError("a bug")

    monkeypatch.setattr(store, "purge", broken)
    finished("a")
    thread = housekeeping("a")
    thread.start()
    try:
        first = Consumer.objects.get(pk=thread.consumer.pk).last_heartbeat_at
        assert wait_for(lambda: len(calls) >= 3, timeout=20)
        assert wait_for(
            lambda: Consumer.objects.get(pk=thread.consumer.pk).last_heartbeat_at > first,
            timeout=20,
        )
        assert thread.thread.is_alive()
    finally:
        thread.stopping.set()
        thread.stop()


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("fast_consumers")
class TestUnderAWorker:
    """The thread as a consumer (``Worker``) runs it, handlers and all."""

    def test_leases_are_renewed_while_a_handler_runs(self):
        item = Queue("slow").enqueue({"seconds": 1.5})
        with running(worker_for("slow", lease=0.5)):
            assert wait_for(lambda: Run.objects.exists())
            time.sleep(1.0)  # twice the lease: without renewal the item would be stuck
            assert not Queue("slow").items.stuck().exists()
            assert wait_for(lambda: Queue("slow").count(status=Status.DONE) == 1)
        assert QueueItem.objects.get(pk=item.pk).attempts == 1

    def test_a_handler_past_its_timeout_loses_its_lease(self, settings):
        settings.TXQUEUE = {**settings.TXQUEUE, "QUEUES": {"slow": {"TIMEOUT": 0.2}}}
        item = Queue("slow").enqueue({"seconds": 2})

        def lapsed_or_rescued():
            # The worker's own rescue (every 0.2 s here) may take it back at once.
            stored = QueueItem.objects.get(pk=item.pk)
            return (
                stored.status == Status.READY
                and stored.attempts == 1
                or (Queue("slow").items.stuck().exists())
            )

        with running(worker_for("slow", lease=0.5)):
            assert wait_for(lapsed_or_rescued, timeout=5)

    def test_a_handler_stopped_past_its_timeout_changes_nothing_when_it_returns(self, settings):
        """Its attempt failed at the timeout (docs/limits.md) and its consumer stopped; the
        item runs again under another claim, and when the first handler returns at last,
        nothing of it is written."""
        settings.TXQUEUE = {
            **settings.TXQUEUE,
            "RETRY_DELAY": 0.1,
            "QUEUES": {"slow": {"TIMEOUT": 0.2}},
        }
        item = Queue("slow").enqueue({"seconds": 1.5})
        worker = worker_for("slow", lease=0.5)
        with running(worker) as thread:
            assert wait_for(lambda: not thread.is_alive(), timeout=5)  # stopped by itself
        stored = QueueItem.objects.get(pk=item.pk)
        assert (stored.status, stored.attempts) == (Status.READY, 1)
        assert stored.error_class == "django_txqueue.ItemTimeout"
        second = wait_for(lambda: Queue("slow").claim(1, pid="second", lease=600), timeout=5)
        assert second[0].pk == item.pk and second[0].attempts == 2
        time.sleep(1.5)  # the first handler returns meanwhile
        stored = QueueItem.objects.get(pk=item.pk)
        assert (stored.status, stored.pid, stored.result, stored.finished_at) == (
            Status.IN_PROGRESS,
            "second",
            None,
            None,
        )
        assert second[0].ack(result={"by": "second"}) is True
        assert list(Run.objects.values_list("item_id", "consumer")) == [(item.pk, worker.identity)]

    def test_a_dead_consumers_items_are_rescued_and_finished(self):
        Consumer.objects.create(identity="gone", host="h", os_pid=1, stopped_at=timezone.now())
        Queue("echo").enqueue_many([{}] * 3)
        Queue("echo").claim(2, pid="gone", lease=600)
        with running(worker_for("echo")):
            assert wait_for(lambda: Queue("echo").count(status=Status.DONE) == 3)
        assert set(QueueItem.objects.values_list("attempts", flat=True)) <= {1, 2}

    def test_rescue_fail_setting_fails_instead_of_rerunning(self, settings):
        settings.TXQUEUE = {**settings.TXQUEUE, "QUEUES": {"echo": {"RESCUE": "fail"}}}
        Consumer.objects.create(identity="gone", host="h", os_pid=1, stopped_at=timezone.now())
        item = Queue("echo").enqueue({})
        Queue("echo").claim(1, pid="gone", lease=600)
        with running(worker_for("echo")):
            assert wait_for(lambda: Queue("echo").count(status=Status.FAILED) == 1)
        assert not Run.objects.filter(item_id=item.pk).exists()
