"""Every state change after a claim (django_txqueue.store): acknowledgements and their
fencing, release, retry, fail, rescue of stuck items, lease renewal, consumer rows, and
the named lock the purge takes.

Claims themselves are in test_claim.py.
"""

import datetime as dt
import os
import subprocess
import sys
import time

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_txqueue import Queue, Status, store
from django_txqueue.models import Consumer, QueueItem
from django_txqueue.store import Ack
from tests.helpers import ROOT, child_env, expire, in_other_thread, wait_for
from tests.testapp.models import Thing


class TestFencing:
    def test_ack_marks_done_with_result(self, queue, strategy):
        queue.enqueue({})
        [item] = queue.claim(strategy=strategy)
        assert item.ack(result={"sent": True}) is True
        stored = QueueItem.objects.get(pk=item.pk)
        assert (stored.status, stored.result) == (Status.DONE, {"sent": True})
        assert stored.finished_at is not None
        assert item.finished_at == stored.finished_at  # deferred, loaded on access

    def test_expired_and_reclaimed_item_fences_the_old_holder(self, queue, strategy):
        queue.enqueue({})
        [old] = queue.claim(strategy=strategy, pid="slow-worker")
        expire(old)
        assert queue.requeue_stuck() == 1
        [new] = queue.claim(strategy=strategy, pid="fast-worker")
        assert new.pk == old.pk and new.attempts == 2
        for verb in (
            lambda: old.ack(result="late"),
            old.release,
            lambda: old.fail("late"),
            lambda: old.retry("late"),
        ):
            assert verb() is False
        stored = QueueItem.objects.get(pk=old.pk)
        assert (stored.status, stored.pid, stored.result, stored.last_error) == (
            Status.IN_PROGRESS,
            "fast-worker",
            None,
            "",
        )
        assert new.ack() is True

    def test_second_claim_by_the_same_pid_fences_the_first(self, queue, strategy):
        queue.enqueue({})
        [first] = queue.claim(strategy=strategy, pid="me")
        expire(first)
        queue.requeue_stuck()
        [second] = queue.claim(strategy=strategy, pid="me")
        assert first.ack() is False
        assert second.ack() is True

    def test_expired_lease_alone_does_not_fence(self, queue, strategy):
        queue.enqueue({})
        [item] = queue.claim(strategy=strategy)
        expire(item)
        assert item.ack() is True

    def test_retry_after_a_release_is_refused_without_reading_the_row(self, queue):
        """The release deferred the item's attempts (the database computed them); retry()
        is refused from what the item knows, as ack(), fail() and release() are, and does
        not load them: once the row was purged that load raised DoesNotExist. Found by
        test_model_based.py."""
        queue.enqueue({})
        [item] = queue.claim()
        assert item.release() is True
        QueueItem.objects.filter(pk=item.pk).delete()
        with CaptureQueriesContext(connection) as queries:
            assert item.retry("late") is False
        assert queries.captured_queries == []

    def test_ack_twice(self, queue):
        queue.enqueue({})
        [item] = queue.claim()
        assert item.ack() is True
        assert item.ack() is False

    def test_unclaimed_item_cannot_be_acknowledged(self, queue):
        item = queue.enqueue({})
        assert item.ack() is False
        assert QueueItem.objects.get(pk=item.pk).status == Status.READY

    def test_ack_rejects_a_non_json_result_and_changes_nothing(self, queue):
        queue.enqueue({})
        [item] = queue.claim()
        with pytest.raises(TypeError, match="result"):
            item.ack(result=object())
        assert QueueItem.objects.get(pk=item.pk).status == Status.IN_PROGRESS

    def test_queue_model_subclass_verbs(self, db, strategy):
        Thing.objects.bulk_create([Thing(name="a"), Thing(name="b"), Thing(name="c")])
        a, b, c = Thing.objects.claim(3, strategy=strategy)
        assert a.ack() and b.fail("no column, not kept") and c.release()
        assert dict(Thing.objects.values_list("name", "status")) == {
            "a": Status.DONE,
            "b": Status.FAILED,
            "c": Status.READY,
        }
        assert Thing.objects.get(name="c").attempts == 0


class TestRelease:
    def test_release_puts_back_without_counting_the_attempt(self, queue, strategy):
        queue.enqueue({})
        [item] = queue.claim(strategy=strategy)
        assert item.release() is True
        stored = QueueItem.objects.get(pk=item.pk)
        assert (stored.status, stored.attempts, stored.pid, stored.claim_token) == (
            Status.READY,
            0,
            "",
            None,
        )
        assert queue.claim(strategy=strategy)[0].pk == item.pk


class TestRetry:
    def test_retry_schedules_with_backoff(self, queue, strategy, settings):
        settings.TXQUEUE = {"RETRY_DELAY": 60, "RETRY_MAX_DELAY": 600}
        queue.enqueue({})
        [item] = queue.claim(strategy=strategy)
        assert item.retry("timeout") is True
        stored = QueueItem.objects.get(pk=item.pk)
        assert (stored.status, stored.last_error, stored.attempts) == (Status.READY, "timeout", 1)
        wait = stored.run_at - timezone.now()
        assert dt.timedelta(seconds=25) < wait <= dt.timedelta(seconds=60)
        assert queue.claim(strategy=strategy) == []

    def test_retry_with_explicit_delay(self, queue):
        queue.enqueue({})
        [item] = queue.claim()
        item.retry(delay=0)
        assert queue.claim()[0].attempts == 2

    def test_failed_after_max_attempts_with_error_kept(self, queue, strategy):
        queue.enqueue({}, max_attempts=3)
        for attempt in range(1, 4):
            [item] = queue.claim(strategy=strategy)
            assert item.attempts == attempt
            assert item.retry(f"error {attempt}", delay=0) is True
        stored = QueueItem.objects.get(pk=item.pk)
        assert (stored.status, stored.last_error) == (Status.FAILED, "error 3")
        assert stored.finished_at is not None
        assert queue.claim(strategy=strategy) == []


class TestStuck:
    def test_requeue_stuck_rescues_expired_leases_only(self, queue, strategy):
        queue.enqueue_many([{}] * 3)
        stuck, alive, _ = queue.claim(3, strategy=strategy)
        expire(stuck)
        assert list(queue.items.stuck()) == [stuck]
        assert queue.requeue_stuck() == 1
        assert QueueItem.objects.get(pk=stuck.pk).status == Status.READY
        assert QueueItem.objects.get(pk=alive.pk).status == Status.IN_PROGRESS

    def test_items_of_a_dead_consumer_are_stuck_before_their_lease_ends(self, queue):
        queue.enqueue_many([{}] * 2)
        Consumer.objects.create(identity="dead", host="h", os_pid=1, stopped_at=timezone.now())
        Consumer.objects.create(identity="alive", host="h", os_pid=2)
        [orphan] = queue.claim(1, pid="dead", lease=600)
        [kept] = queue.claim(1, pid="alive", lease=600)
        assert [i.pk for i in queue.items.stuck()] == [orphan.pk]

    def test_spent_attempts_end_failed(self, queue):
        queue.enqueue({}, max_attempts=1)
        [item] = queue.claim()
        expire(item)
        assert queue.requeue_stuck() == 1
        stored = QueueItem.objects.get(pk=item.pk)
        assert stored.status == Status.FAILED
        assert "attempts spent" in stored.last_error


class TestAckMany:
    def test_acknowledges_only_the_rows_of_that_claim(self, queue, strategy):
        queue.enqueue_many([{}] * 3)
        a, b = queue.claim(2, strategy=strategy)
        [other] = queue.claim(1, strategy=strategy)
        acknowledged = store.ack_many(
            QueueItem, "default", Ack(a.claim_token, {a.pk: {"n": 1}, b.pk: None, other.pk: 3})
        )
        assert acknowledged == 2
        stored = {item.pk: item for item in QueueItem.objects.all()}
        assert (stored[a.pk].status, stored[a.pk].result) == (Status.DONE, {"n": 1})
        assert (stored[b.pk].status, stored[b.pk].result) == (Status.DONE, None)
        assert stored[a.pk].finished_at is not None and stored[a.pk].lease_expires_at is None
        assert (stored[other.pk].status, stored[other.pk].result) == (Status.IN_PROGRESS, None)

    def test_a_second_acknowledgement_changes_nothing(self, queue):
        queue.enqueue({})
        [item] = queue.claim()
        results = {item.pk: "first"}
        assert store.ack_many(QueueItem, "default", Ack(item.claim_token, results)) == 1
        assert store.ack_many(QueueItem, "default", Ack(item.claim_token, {item.pk: "again"})) == 0
        assert QueueItem.objects.get(pk=item.pk).result == "first"

    def test_nothing_to_acknowledge_runs_no_query(self, db):
        with CaptureQueriesContext(connection) as queries:
            assert store.ack_many(QueueItem, "default", Ack(1, {})) == 0
        assert not queries.captured_queries


class TestErrorClass:
    def test_retry_and_fail_keep_the_error_class(self, queue):
        queue.enqueue({}, max_attempts=2)
        [item] = queue.claim()
        assert store.retry(item, "first", delay=0, error_class="builtins.ValueError")
        stored = QueueItem.objects.get(pk=item.pk)
        assert (stored.status, stored.last_error, stored.error_class) == (
            Status.READY,
            "first",
            "builtins.ValueError",
        )
        [item] = queue.claim()
        # Attempts spent: the retry fails it, with the class of this attempt's error.
        assert store.retry(item, "second", error_class="builtins.KeyError")
        stored = QueueItem.objects.get(pk=item.pk)
        assert (stored.status, stored.last_error, stored.error_class) == (
            Status.FAILED,
            "second",
            "builtins.KeyError",
        )

    def test_a_failure_without_a_class_clears_an_earlier_attempts_class(self, queue):
        queue.enqueue({})
        [item] = queue.claim()
        store.retry(item, "first", delay=0, error_class="builtins.ValueError")
        [item] = queue.claim()
        assert item.fail("by hand") is True
        stored = QueueItem.objects.get(pk=item.pk)
        assert (stored.status, stored.last_error, stored.error_class) == (
            Status.FAILED,
            "by hand",
            "",
        )
        assert stored.finished_at is not None

    def test_fail_without_an_error_keeps_an_empty_one(self, queue):
        queue.enqueue({})
        [item] = queue.claim()
        assert store.fail(item) is True
        stored = QueueItem.objects.get(pk=item.pk)
        assert (stored.status, stored.last_error, stored.error_class) == (Status.FAILED, "", "")


class TestReleaseAndFailFencing:
    def test_verbs_on_an_unclaimed_or_finished_item_return_false(self, queue):
        unclaimed = queue.enqueue({})
        assert unclaimed.release() is False
        assert unclaimed.fail("x") is False
        assert unclaimed.retry("x") is False
        [item] = queue.claim()
        assert item.ack() is True
        assert (item.release(), item.fail("late"), item.retry("late")) == (False, False, False)
        stored = QueueItem.objects.get(pk=item.pk)
        assert (stored.status, stored.last_error, stored.attempts) == (Status.DONE, "", 1)

    def test_a_rescued_item_fences_its_old_holder_before_anyone_claims_it(self, queue, strategy):
        queue.enqueue({})
        [item] = queue.claim(strategy=strategy)
        expire(item)
        assert queue.requeue_stuck() == 1
        assert (item.ack(), item.release(), item.fail("late")) == (False, False, False)
        stored = QueueItem.objects.get(pk=item.pk)
        assert (stored.status, stored.pid, stored.claim_token) == (Status.READY, "", None)


class TestRescue:
    def test_rescue_fail_fails_every_stuck_item_at_once(self, queue):
        queue.enqueue_many([{}] * 2)
        first, second = queue.claim(2)
        store.retry(first, "earlier", delay=0, error_class="builtins.ValueError")
        [first] = queue.claim(1)
        expire(first)
        expire(second)
        assert store.rescue(queue.items.stuck(), fail=True) == 2
        for stored in queue.items.all():
            assert stored.status == Status.FAILED
            assert stored.last_error == "stuck: lease expired or consumer died"
            assert stored.error_class == ""  # the earlier attempt's class is not this failure's
            assert stored.finished_at is not None
            assert (stored.pid, stored.claim_token, stored.lease_expires_at) == ("", None, None)

    def test_rescue_back_to_ready_keeps_the_last_attempts_error(self, queue):
        queue.enqueue({})
        [item] = queue.claim()
        store.retry(item, "earlier", delay=0, error_class="builtins.ValueError")
        [item] = queue.claim()
        expire(item)
        assert store.rescue(queue.items.stuck()) == 1
        stored = QueueItem.objects.get(pk=item.pk)
        assert (stored.status, stored.attempts, stored.finished_at) == (Status.READY, 2, None)
        assert (stored.last_error, stored.error_class) == ("earlier", "builtins.ValueError")

    def test_queue_rescue_setting_fail(self, db, settings):
        settings.TXQUEUE = {"QUEUES": {"once": {"rescue": "fail"}}}
        once = Queue("once")
        once.enqueue({})
        [item] = once.claim()
        expire(item)
        assert once.requeue_stuck() == 1
        assert once.items.get().status == Status.FAILED

    def test_a_queue_model_without_attempt_limits_always_goes_back_to_ready(self, db, strategy):
        Thing.objects.bulk_create([Thing(name="a"), Thing(name="b")])
        stuck, alive = Thing.objects.claim(2, strategy=strategy, lease=600)
        Thing.objects.filter(pk=stuck.pk).update(
            lease_expires_at=timezone.now() - dt.timedelta(seconds=5)
        )
        assert list(Thing.objects.stuck()) == [stuck]
        assert Thing.objects.requeue_stuck() == 1
        rescued = Thing.objects.get(pk=stuck.pk)
        assert (rescued.status, rescued.pid, rescued.claim_token) == (Status.READY, "", None)
        assert Thing.objects.get(pk=alive.pk).status == Status.IN_PROGRESS
        assert stuck.ack() is False


class TestRenewLeases:
    def test_renews_only_items_still_held_by_their_claim(self, queue, strategy):
        queue.enqueue_many([{}] * 3)
        held, acked, taken_over = queue.claim(3, strategy=strategy, lease=60)
        assert acked.ack()
        expire(taken_over)
        queue.requeue_stuck()
        [again] = queue.claim(strategy=strategy, lease=60)
        assert again.pk == taken_over.pk

        renewed = store.renew_leases(
            QueueItem,
            "default",
            {
                held.pk: held.claim_token,
                acked.pk: acked.claim_token,
                again.pk: taken_over.claim_token,
            },
            dt.timedelta(seconds=600),
        )

        assert renewed == 1
        stored = {item.pk: item for item in QueueItem.objects.all()}
        lease = stored[held.pk].lease_expires_at - stored[held.pk].claimed_at
        assert dt.timedelta(seconds=599) <= lease <= dt.timedelta(seconds=660)
        assert stored[acked.pk].lease_expires_at is None
        lease = stored[again.pk].lease_expires_at - stored[again.pk].claimed_at
        assert lease <= dt.timedelta(seconds=61)

    def test_renewal_moves_an_expired_lease_forward(self, queue):
        queue.enqueue({})
        [item] = queue.claim()
        expire(item)
        assert queue.items.stuck().exists()
        assert (
            store.renew_leases(
                QueueItem, "default", {item.pk: item.claim_token}, dt.timedelta(seconds=60)
            )
            == 1
        )
        assert not queue.items.stuck().exists()

    def test_nothing_to_renew_runs_no_query(self, db):
        with CaptureQueriesContext(connection) as queries:
            assert store.renew_leases(QueueItem, "default", {}, dt.timedelta(seconds=1)) == 0
        assert not queries.captured_queries


class TestConsumerRows:
    def test_register_beat_and_stop(self, queue):
        consumer = store.register(
            Consumer(identity=store.new_identity(), host="h", os_pid=os.getpid()), "default"
        )
        stored = Consumer.objects.get(pk=consumer.pk)
        assert stored.stopped_at is None and (stored.processed, stored.failed) == (0, 0)
        assert Consumer.objects.alive().filter(pk=consumer.pk).exists()
        Consumer.objects.filter(pk=consumer.pk).update(
            last_heartbeat_at=timezone.now() - dt.timedelta(hours=1)
        )
        assert Consumer.objects.dead().filter(pk=consumer.pk).exists()

        store.beat(consumer, processed=5, failed=2, queues=["a", "found-later"])

        stored = Consumer.objects.get(pk=consumer.pk)
        assert (stored.processed, stored.failed) == (5, 2)
        assert stored.queues == ["a", "found-later"]
        assert Consumer.objects.alive().filter(pk=consumer.pk).exists()
        queue.enqueue({})
        [item] = queue.claim(pid=consumer.identity, lease=600)
        assert not queue.items.stuck().exists()

        store.stop(consumer, processed=6, failed=2)

        stored = Consumer.objects.get(pk=consumer.pk)
        assert stored.stopped_at is not None and stored.processed == 6
        assert [i.pk for i in queue.items.stuck()] == [item.pk]  # its consumer stopped

    def test_identities_are_new_each_time_and_after_a_reset(self):
        first, second = store.new_identity(), store.new_identity()
        assert first != second
        assert first.rsplit(":", 2)[1] == str(os.getpid())
        before = store.consumer_identity()
        assert store.consumer_identity() == before  # one per process...
        store.ConsumerIdentity.reset()  # ...and a new one after a fork
        try:
            assert store.consumer_identity() != before
        finally:
            store.ConsumerIdentity._value = before


@pytest.mark.parametrize("wait", [0, 5])
def test_now_plus_is_the_database_clock(queue, wait):
    item = queue.enqueue({})
    QueueItem.objects.filter(pk=item.pk).update(run_at=store.now_plus(dt.timedelta(seconds=wait)))
    stored = QueueItem.objects.get(pk=item.pk)
    offset = stored.run_at - stored.created_at
    assert dt.timedelta(seconds=wait) <= offset <= dt.timedelta(seconds=wait + 2)
    assert queue.items.ready().exists() is (wait == 0)


def ack_many(results, token):
    return store.ack_many(QueueItem, "default", Ack(token, results))


class TestBatchAckFencing:
    """``ack_many``, the consumer's acknowledgement path, is fenced like ``ack()``."""

    def take_over(self, queue, strategy, *items):
        """Another consumer takes ``items`` over: their leases lapse, a rescue puts them
        back READY, and a new claim holds them. Returns that new claim's items."""
        for item in items:
            expire(item)
        assert queue.requeue_stuck() == len(items)
        taken = queue.claim(len(items), strategy=strategy, pid="second")
        assert sorted(i.pk for i in taken) == sorted(i.pk for i in items)
        return taken

    def rows(self, items):
        fields = ("status", "pid", "claim_token", "result", "attempts", "finished_at")
        return {
            row["id"]: tuple(row[name] for name in fields)
            for row in QueueItem.objects.filter(pk__in=[i.pk for i in items]).values("id", *fields)
        }

    @pytest.mark.parametrize("results", ["values", "none"])
    def test_a_late_batch_ack_with_the_old_token_changes_nothing(self, queue, strategy, results):
        queue.enqueue_many([{"n": n} for n in range(3)])
        old = queue.claim(3, strategy=strategy, pid="first")
        old_token = old[0].claim_token
        new = self.take_over(queue, strategy, *old)
        new_token = new[0].claim_token
        assert new_token != old_token
        before = self.rows(old)

        late = {i.pk: ({"late": i.pk} if results == "values" else None) for i in old}
        assert ack_many(late, old_token) == 0

        assert self.rows(old) == before
        assert set(before.values()) == {(Status.IN_PROGRESS, "second", new_token, None, 2, None)}
        # The new holder still acknowledges them.
        assert ack_many({i.pk: "second" for i in new}, new_token) == 3
        assert set(queue.items.values_list("status", "result")) == {(Status.DONE, "second")}

    def test_a_partly_taken_over_batch_acks_only_the_rows_still_held(self, queue, strategy):
        queue.enqueue_many([{"n": n} for n in range(4)])
        kept, taken, released, also_kept = queue.claim(4, strategy=strategy, pid="first")
        token = kept.claim_token
        [retaken] = self.take_over(queue, strategy, taken)
        assert released.release() is True  # READY again, not held by anyone

        results = {
            item.pk: {"by": "first", "n": item.payload["n"]}
            for item in (kept, taken, released, also_kept)
        }
        assert ack_many(results, token) == 2

        rows = self.rows([kept, taken, released, also_kept])
        for item in (kept, also_kept):
            status, pid, _, result, attempts, finished_at = rows[item.pk]
            assert (status, pid, result, attempts) == (Status.DONE, "first", results[item.pk], 1)
            assert finished_at is not None
        assert rows[taken.pk] == (
            Status.IN_PROGRESS,
            "second",
            retaken.claim_token,
            None,
            2,
            None,
        )
        assert rows[released.pk] == (Status.READY, "", None, None, 0, None)
        # Acknowledging again under the old token changes nothing more.
        assert ack_many(results, token) == 0
        assert self.rows([kept, taken, released, also_kept]) == rows


class TestReleaseLost:
    """A claim whose answer never reached its consumer: released, attempt not counted."""

    def test_only_old_claims_of_this_pid_that_it_does_not_hold(self, queue, strategy):
        queue.enqueue_many([{"n": n} for n in range(4)])
        lost, held, recent = queue.claim(3, strategy=strategy, pid="me")
        [other] = queue.claim(1, strategy=strategy, pid="someone else")
        QueueItem.objects.filter(pk__in=[lost.pk, held.pk, other.pk]).update(
            claimed_at=timezone.now() - dt.timedelta(seconds=30)
        )

        released = store.release_lost(
            QueueItem, "default", "me", [held.pk], dt.timedelta(seconds=10)
        )

        assert released == 1
        rows = dict(QueueItem.objects.values_list("pk", "status"))
        assert rows == {
            lost.pk: Status.READY,
            held.pk: Status.IN_PROGRESS,
            recent.pk: Status.IN_PROGRESS,
            other.pk: Status.IN_PROGRESS,
        }
        again = QueueItem.objects.get(pk=lost.pk)
        assert (again.attempts, again.pid, again.claim_token) == (0, "", None)
        assert lost.ack() is False  # the lost claim is fenced off


LOCK = "txqueue_test_lock"


def try_lock_now(alias="default"):
    with store.try_lock(alias, LOCK) as held:
        return held


class TestTryLock:
    """``store.try_lock``: a named lock (the purge's), tried and never waited for."""

    # transactional_db: PostgreSQL's lock is its transaction's, and under ``db`` the test's
    # own transaction would hold it to the end of the test.
    def test_while_one_connection_holds_it_another_connection_fails_at_once(
        self, transactional_db
    ):
        with store.try_lock("default", LOCK) as held:
            assert held
            started = time.monotonic()
            assert in_other_thread(try_lock_now) is False
            assert time.monotonic() - started < 5  # tried, did not wait
        assert in_other_thread(try_lock_now) is True  # released
        assert try_lock_now() is True

    def test_released_when_the_work_under_it_raises(self, transactional_db):
        with pytest.raises(ValueError, match="purge broke"), store.try_lock("default", LOCK):
            raise ValueError("purge broke")
        assert in_other_thread(try_lock_now) is True

    def test_locks_of_other_names_are_independent(self, db):
        with store.try_lock("default", LOCK) as held:
            assert held
            with store.try_lock("default", LOCK + "_other") as other:
                assert other

    def test_across_processes(self, db):
        child = subprocess.Popen(  # noqa: S603 - our own command line
            [
                sys.executable,
                "-c",
                "import sys, django; django.setup()\n"
                "from django_txqueue import store\n"
                "with store.try_lock('default', sys.argv[1]) as held:\n"
                "    print(held, flush=True)\n"
                "    sys.stdin.readline()\n",
                LOCK,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**child_env(), "DJANGO_SETTINGS_MODULE": "tests.settings"},
            cwd=ROOT,
            text=True,
        )
        with child:
            try:
                assert child.stdout.readline().strip() == "True"
                assert try_lock_now() is False
                _, err = child.communicate("\n", timeout=30)
                assert child.returncode == 0, err
                assert try_lock_now() is True
            finally:
                if child.poll() is None:
                    child.kill()

    def test_a_dead_holders_lock_is_free(self, db):
        child = subprocess.run(  # noqa: S603 - our own command line
            [
                sys.executable,
                "-c",
                "import os, sys, django; django.setup()\n"
                "from django_txqueue import store\n"
                "lock = store.try_lock('default', sys.argv[1])\n"
                "assert lock.__enter__()\n"
                "os._exit(0)  # no release\n",
                LOCK,
            ],
            env={**child_env(), "DJANGO_SETTINGS_MODULE": "tests.settings"},
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert child.returncode == 0, child.stderr
        assert wait_for(try_lock_now, timeout=10)
