"""django_txqueue.consumer.settle: what handlers came to, written by the consumer's main thread.

One fenced acknowledgement per claim for the successes, a retry or a failure for each
error, then the counters and signals, and the next claim in the same call; an outcome
leaves ``unsettled`` only once the database has it.
"""

import logging

import pytest
from django.db import DatabaseError, Error, connection
from django.test.utils import CaptureQueriesContext

from django_txqueue import Status, signals, store
from django_txqueue.consumer.execution import Outcome, drop_connection
from django_txqueue.consumer.settle import Settler
from django_txqueue.models import QueueItem
from django_txqueue.store import Ack
from tests.helpers import expire, lose_connection


def acknowledgements(queries):
    """The UPDATEs that marked items DONE (status, result, finished_at, lease, fenced)."""
    return [
        q["sql"]
        for q in queries.captured_queries
        if q["sql"].startswith("UPDATE") and "finished_at" in q["sql"]
    ]


def failure(exc, item, **options):
    outcome = Outcome(item)
    try:
        raise exc
    except Exception as raised:
        outcome.failed(raised, **options)
    return outcome


def stored(item):
    return QueueItem.objects.get(pk=item.pk)


class TestOutcome:
    def test_a_failure_keeps_the_traceback_and_the_exception_class(self, queue):
        item = queue.enqueue({})
        outcome = failure(ValueError("no seat 12"), item, retry=False)
        assert outcome.error.startswith("Traceback (most recent call last):")
        assert outcome.error.rstrip().endswith("ValueError: no seat 12")
        assert (outcome.error_class, outcome.retry) == ("builtins.ValueError", False)


class TestSuccesses:
    def test_a_claims_successes_are_acknowledged_in_one_statement(self, queue):
        queue.enqueue_many([{"n": n} for n in range(5)])
        claimed = queue.claim(5)
        settler = Settler("default")
        arrived = [Outcome(item, result={"n": item.payload["n"]}) for item in claimed[:3]]
        arrived += [Outcome(item, result=None) for item in claimed[3:]]
        with CaptureQueriesContext(connection) as queries:
            settled = settler.settle(arrived)
        assert len(settled) == 5 and settler.unsettled == []
        assert len(acknowledgements(queries)) == 1
        rows = {row.pk: row for row in queue.items.all()}
        assert {row.status for row in rows.values()} == {Status.DONE}
        assert [rows[item.pk].result for item in claimed] == [
            {"n": 0},
            {"n": 1},
            {"n": 2},
            None,
            None,
        ]
        assert all(row.finished_at is not None for row in rows.values())
        assert (settler.processed, settler.failed) == (5, 0)

    def test_each_claim_gets_its_own_acknowledgement(self, queue):
        queue.enqueue_many([{}] * 4)
        first, second = queue.claim(2), queue.claim(2)
        settler = Settler("default")
        arrived = [Outcome(item) for item in first + second]
        with CaptureQueriesContext(connection) as queries:
            settler.settle(arrived)
        assert len(acknowledgements(queries)) == 2
        assert queue.count(status=Status.DONE) == 4

    def test_nothing_received_writes_nothing(self, db):
        settler = Settler("default")
        with CaptureQueriesContext(connection) as queries:
            assert settler.settle([]) == []
        assert queries.captured_queries == []

    def test_a_taken_over_claim_is_refused_logged_and_settled_all_the_same(self, queue, caplog):
        """The first claim's lease ran out and another consumer claimed one item again: only
        the item still held is acknowledged; the other stays the new claim's."""
        queue.enqueue_many([{}] * 2)
        kept, lost = queue.claim(2, pid="first")
        expire(lost)
        assert queue.requeue_stuck() == 1
        [again] = queue.claim(1, pid="second")
        settler = Settler("default")
        arrived = [Outcome(kept), Outcome(lost)]
        with caplog.at_level(logging.WARNING, logger="django_txqueue.settle"):
            assert len(settler.settle(arrived)) == 2
        assert "1 of 2 acknowledgements refused: their claims were taken over" in caplog.text
        assert settler.unsettled == []
        assert stored(kept).status == Status.DONE
        assert (stored(again).status, stored(again).pid) == (Status.IN_PROGRESS, "second")

    def test_a_late_acknowledgement_does_not_count_as_processed(self, queue):
        """The consumer's counters and signals see only what committed."""
        queue.enqueue_many([{}, {}])
        refused, accepted = queue.claim(2)
        settler = Settler("default")
        arrived = [Outcome(refused, acknowledged=False), Outcome(accepted, acknowledged=True)]
        assert len(settler.settle(arrived)) == 2
        assert (settler.processed, settler.failed) == (1, 0)
        # The settler writes nothing for either: their handlers' transactions did.
        assert set(queue.items.values_list("status", flat=True)) == {Status.IN_PROGRESS}


class TestErrors:
    def test_an_error_with_attempts_left_is_retried_later(self, queue, settings):
        settings.TXQUEUE = {**settings.TXQUEUE, "RETRY_DELAY": 60, "RETRY_MAX_DELAY": 60}
        item = queue.enqueue({}, max_attempts=3)
        [claimed] = queue.claim()
        settler = Settler("default")
        arrived = [failure(ValueError("gateway down"), claimed)]
        assert settler.settle(arrived)[0].item.pk == item.pk
        row = stored(item)
        assert (row.status, row.attempts, row.error_class) == (
            Status.READY,
            1,
            "builtins.ValueError",
        )
        assert "ValueError: gateway down" in row.last_error
        assert queue.claim() == []  # not due for half a minute at least
        assert (settler.processed, settler.failed) == (0, 1)

    def test_an_error_on_the_last_attempt_fails_the_item(self, queue):
        item = queue.enqueue({}, max_attempts=1)
        [claimed] = queue.claim()
        settler = Settler("default")
        arrived = [failure(ValueError("gateway down"), claimed)]
        settler.settle(arrived)
        row = stored(item)
        assert (row.status, row.error_class) == (Status.FAILED, "builtins.ValueError")
        assert row.finished_at is not None

    def test_an_error_not_worth_a_retry_fails_at_once(self, queue):
        item = queue.enqueue({}, max_attempts=5)
        [claimed] = queue.claim()
        settler = Settler("default")
        arrived = [failure(TypeError("not JSON"), claimed, retry=False)]
        settler.settle(arrived)
        assert (stored(item).status, stored(item).attempts) == (Status.FAILED, 1)

    def test_what_the_database_has_leaves_unsettled_the_rest_waits(self, queue, monkeypatch):
        """The connection breaks at the retry: the acknowledgement before it is settled,
        the error is written on a later turn, which returns both."""
        queue.enqueue_many([{}] * 2)
        succeeded, failed = queue.claim(2)
        settler = Settler("default")
        arrived = [Outcome(succeeded), failure(ValueError("boom"), failed)]
        retry = store.retry

        def broken(*args, **kwargs):
            raise DatabaseError("server closed the connection unexpectedly")

        monkeypatch.setattr(store, "retry", broken)
        with pytest.raises(DatabaseError):
            settler.settle(arrived)
        assert [outcome.item.pk for outcome in settler.unsettled] == [failed.pk]
        assert (settler.processed, settler.failed) == (1, 0)
        assert stored(succeeded).status == Status.DONE

        monkeypatch.setattr(store, "retry", retry)
        # The success settled before the break is returned now, with the error.
        assert [outcome.item.pk for outcome in settler.settle([])] == [succeeded.pk, failed.pk]
        assert settler.unsettled == []
        assert (settler.processed, settler.failed) == (1, 1)
        assert stored(failed).status == Status.READY and "boom" in stored(failed).last_error


class TestRiding:
    """``settle_and_claim``: the settler writes what arrived and claims from its rotation,
    one claim's successes riding with that claim where the database acknowledges while
    claiming (the statements: tests/test_hotpath.py)."""

    def settler(self, queue, batch=3):
        from django_txqueue.consumer.claims import Claimer
        from django_txqueue.consumer.rotation import Rotation
        from django_txqueue.db import dialect_for

        rotation = Rotation({queue.name: lambda item: None}, "default")
        claimer = Claimer(rotation.queues, pid="settler-test")
        rides = dialect_for("default").acks_while_claiming
        return Settler("default", rotation=rotation, claimer=claimer, batch=batch, rides=rides)

    def test_successes_are_acknowledged_and_the_next_batch_claimed(self, queue):
        queue.enqueue_many([{}] * 5)
        claimed = queue.claim(3)
        settler = self.settler(queue)
        arrived = [Outcome(item, result=item.pk) for item in claimed]
        settled, more = settler.settle_and_claim(arrived, room=0)
        assert sorted(o.item.pk for o in settled) == sorted(item.pk for item in claimed)
        assert len(more) == 2  # the room the settled items freed, up to what is left
        assert settler.unsettled == [] and settler.processed == 3
        assert queue.count(status=Status.DONE) == 3
        assert {stored(item).result for item in claimed} == {item.pk for item in claimed}

    def test_errors_are_written_before_the_claim(self, queue):
        queue.enqueue_many([{}] * 2)
        succeeded, failed = queue.claim(2)
        settler = self.settler(queue)
        arrived = [Outcome(succeeded), failure(ValueError("boom"), failed, retry=False)]
        settled, more = settler.settle_and_claim(arrived, room=0)
        assert {o.item.pk for o in settled} == {succeeded.pk, failed.pk} and more == []
        assert (stored(failed).status, stored(succeeded).status) == (Status.FAILED, Status.DONE)

    def test_no_room_acknowledges_without_claiming(self, queue):
        queue.enqueue_many([{}] * 3)
        [item] = queue.claim(1)
        settler = self.settler(queue, batch=1)
        settled, more = settler.settle_and_claim([Outcome(item)], room=-1)
        assert [o.item.pk for o in settled] == [item.pk] and more == []
        assert stored(item).status == Status.DONE
        assert queue.count(status=Status.READY) == 2

    def test_settle_alone_claims_nothing(self, queue):
        queue.enqueue_many([{}] * 3)
        [item] = queue.claim(1)
        settled = self.settler(queue).settle([Outcome(item)])
        assert [o.item.pk for o in settled] == [item.pk]
        assert queue.count(status=Status.READY) == 2


class TestSignals:
    def test_done_and_failed_are_sent_with_what_the_handler_came_to(self, queue, settings):
        settings.TXQUEUE = {**settings.TXQUEUE, "RETRY_DELAY": 60}
        queue.enqueue_many([{}] * 3)
        done, retried, failed = queue.claim(3)
        seen = []

        def on_done(sender, item, result, duration, **kwargs):
            seen.append(("done", item.pk, result, duration))

        def on_failed(sender, item, error, will_retry, duration, **kwargs):
            seen.append(("failed", item.pk, error.splitlines()[-1], will_retry, duration))

        signals.item_done.connect(on_done)
        signals.item_failed.connect(on_failed)
        try:
            settler = Settler("default")
            settler.settle(
                [
                    Outcome(done, result={"sent": 1}, duration=0.5),
                    failure(ValueError("again"), retried),
                    failure(ValueError("never"), failed, retry=False),
                ]
            )
        finally:
            signals.item_done.disconnect(on_done)
            signals.item_failed.disconnect(on_failed)
        assert sorted(seen, key=lambda event: event[1]) == [
            ("done", done.pk, {"sent": 1}, 0.5),
            ("failed", retried.pk, "ValueError: again", True, 0.0),
            ("failed", failed.pk, "ValueError: never", False, 0.0),
        ]


class TestDatabasesFailure:
    """An outcome the database failed (``Outcome.lost``: a lost connection, a refused
    transaction) goes back READY at once, no attempt counted; and what was settled before
    a lost connection is still reported as settled (the consumer's in-flight list)."""

    def test_a_lost_outcome_is_ready_again_at_once_with_no_attempt_counted(
        self, queue, caplog, settings
    ):
        settings.TXQUEUE = {**settings.TXQUEUE, "RETRY_DELAY": 60, "RETRY_MAX_DELAY": 60}
        queue.enqueue({})
        [item] = queue.claim(1)
        outcome = failure(DatabaseError("server closed the connection unexpectedly"), item)
        outcome.lost = True
        settler = Settler("default")
        arrived = [outcome]
        with caplog.at_level(logging.WARNING, logger="django_txqueue.settle"):
            assert settler.settle(arrived) == [outcome]
        row = stored(item)
        assert (row.status, row.attempts, row.last_error) == (Status.READY, 0, "")
        assert queue.claim(1)[0].pk == item.pk  # no retry delay
        assert (settler.processed, settler.failed) == (0, 0)
        assert "the database failed, not the handler; back to READY" in caplog.text

    def test_a_lost_outcome_whose_commit_landed_changes_nothing(self, queue, caplog):
        """The atomic handler's COMMIT raised, but the server had it: the row is DONE."""
        queue.enqueue({})
        [item] = queue.claim(1)
        store.ack_many(QueueItem, "default", Ack(item.claim_token, {item.pk: "kept"}))
        outcome = failure(DatabaseError("server closed the connection unexpectedly"), item)
        outcome.lost = True
        settler = Settler("default")
        arrived = [outcome]
        with caplog.at_level(logging.WARNING, logger="django_txqueue.settle"):
            settler.settle(arrived)
        row = stored(item)
        assert (row.status, row.attempts, row.result) == (Status.DONE, 1, "kept")
        assert "settled meanwhile" in caplog.text

    @pytest.mark.django_db(transaction=True)
    def test_what_was_settled_before_the_connection_broke_is_returned_later(self, queue):
        """The connection breaks between two claims' acknowledgements: the first claim's
        items are DONE, and a later ``settle()`` returns them with the rest, so that the
        consumer forgets them (else they stayed "in flight" and its shutdown waited for
        them: "1 items left IN_PROGRESS" with every row DONE)."""
        queue.enqueue_many([{}] * 4)
        first, second = queue.claim(2), queue.claim(2)
        settler = Settler("default")
        arrived = [Outcome(item) for item in first]
        arrived += [Outcome(item) for item in second]
        acks = []

        def break_before_the_second_ack(execute, sql, params, many, context):
            if sql.startswith("UPDATE") and "finished_at" in sql:
                acks.append(sql)
                if len(acks) == 2:
                    lose_connection()  # the server drops it, as at a restart
            return execute(sql, params, many, context)

        with connection.execute_wrapper(break_before_the_second_ack), pytest.raises(Error):
            settler.settle(arrived)
        drop_connection("default")  # what the consumer does before its next turn
        assert {stored(item).status for item in first} == {Status.DONE}

        returned = settler.settle([])
        assert sorted(o.item.pk for o in returned) == sorted(i.pk for i in first + second)
        assert settler.settle([]) == [] and settler.unsettled == []
        assert {row.status for row in queue.items.all()} == {Status.DONE}
