"""``django_txqueue.testing`` and the ``txqueue`` fixture (docs/testing.md), used as a
project's tests use them: with pytest's fixture here, and inside Django's ``TestCase``
(whose test runs in a transaction rolled back after it)."""

import pytest
from django.db import transaction
from django.test import TestCase

from django_txqueue import Queue, Status, enqueue, group, step
from django_txqueue import testing as helpers
from django_txqueue.consumer import registry
from tests.testapp.models import Run


def book_seat(seat, *, broken=False):
    """A project's view: the booking and its SMS commit together."""
    with transaction.atomic():
        enqueue("echo", {"seat": seat, "broken": broken})


@pytest.mark.django_db
def test_assert_enqueued_finds_what_a_test_enqueued(txqueue):
    book_seat(7)
    [item] = txqueue.assert_enqueued("echo", {"seat": 7, "broken": False})
    assert item.status == Status.READY
    txqueue.assert_enqueued("echo", count=1, status=Status.READY)
    txqueue.assert_not_enqueued("echo", {"seat": 8, "broken": False})
    txqueue.assert_not_enqueued("sms")


@pytest.mark.django_db
def test_a_wrong_expectation_fails_and_says_what_the_queue_holds(txqueue):
    book_seat(7)
    with pytest.raises(AssertionError) as wrong:
        txqueue.assert_enqueued("echo", {"seat": 8})
    assert str(wrong.value).startswith("expected an item of queue 'echo' with payload {'seat': 8}")
    assert "found 0; the queue holds: #" in str(wrong.value)
    assert "ready {'seat': 7, 'broken': False}" in str(wrong.value)
    with pytest.raises(AssertionError, match="expected 2 items of queue 'echo', found 1"):
        txqueue.assert_enqueued("echo", count=2)
    with pytest.raises(AssertionError, match="expected no item of queue 'echo', found 1"):
        txqueue.assert_not_enqueued("echo")


@pytest.mark.django_db
def test_drain_runs_what_is_due_through_the_real_path(txqueue):
    Queue("echo").enqueue_many([{"n": n} for n in range(3)])
    Queue("boom").enqueue({"n": 9}, max_attempts=1)
    drained = txqueue.drain()
    assert (drained["done"], drained["failed"]) == (3, 1)
    assert [item.status for item in drained.items].count(Status.DONE) == 3
    assert Run.objects.count() == 3  # the echo handler ran, on this test's connection
    failed = Queue("boom").items.get()
    assert (failed.status, failed.error_class) == (Status.FAILED, "builtins.ValueError")
    assert txqueue.drain().counts == {}  # nothing due: nothing run


@pytest.mark.django_db
def test_drain_of_one_queue_runs_a_flow_to_its_end_and_leaves_retries_for_later(txqueue):
    flow = group(step("echo", {"n": 1}), step("echo", {"n": 2}), then=step("echo", {})).enqueue()
    Queue("boom").enqueue({"n": 9})
    drained = txqueue.drain("echo")
    assert drained.counts == {"done": 3}
    assert [item.pk for item in drained.items][-1] == flow.items[-1].pk  # the then, last
    retried = txqueue.drain("boom")
    assert retried.counts == {"retried": 1}  # READY again, due after its back-off
    assert retried.items[0].status == Status.READY


@pytest.mark.django_db
def test_run_item_runs_one_item_as_a_consumer_would(txqueue):
    first, second = Queue("echo").enqueue_many([{"n": 1}, {"n": 2}])
    done = txqueue.run_item(second)
    assert (done.pk, done.status, done.result, done.attempts) == (
        second.pk,
        Status.DONE,
        {"n": 2},
        1,
    )
    assert Queue("echo").items.get(pk=first.pk).status == Status.READY
    with pytest.raises(
        ValueError, match=f"item #{second.pk} of queue 'echo' is not READY and due"
    ):
        txqueue.run_item(second)


def test_unknown_queues_are_named(db):
    with pytest.raises(ValueError, match="no handler for queue 'nowhere'"):
        helpers.drain("nowhere")


def the_sms_is_sent(seat):
    """A project's test of its own: booking a seat enqueues the SMS, and running the queue
    sends it (the handler's Run row)."""
    helpers.assert_enqueued("echo", {"seat": seat, "broken": False}, count=1)
    drained = helpers.drain("echo")
    assert drained.counts == {"done": 1}, drained.counts
    assert Run.objects.filter(item_id=drained.items[0].pk).exists()


@pytest.mark.django_db
def test_a_test_written_with_them_fails_when_the_handler_is_broken(txqueue, monkeypatch):
    book_seat(1)
    the_sms_is_sent(1)  # passes with the real handler

    def broken(item):
        raise RuntimeError("the SMS gateway's client was misconfigured")

    monkeypatch.setitem(registry._handlers, "echo", broken)
    book_seat(2)
    with pytest.raises(AssertionError, match="'retried': 1"):
        the_sms_is_sent(2)


@pytest.mark.django_db
def test_inline_runs_handlers_at_enqueue_time(txqueue_inline):
    book_seat(5)  # the handler ran before enqueue returned, in this transaction
    [item] = txqueue_inline.assert_enqueued("echo", status=Status.DONE)
    assert item.result == {"seat": 5, "broken": False}
    assert Run.objects.filter(item_id=item.pk).count() == 1
    delayed = enqueue("echo", {"later": True}, delay=3600)
    delayed.refresh_from_db()
    assert delayed.status == Status.READY  # not due: it waits, as in production


@pytest.mark.django_db
def test_inline_runs_what_handlers_enqueue_and_leaves_unhandled_queues(txqueue, monkeypatch):
    def fans_out(item):
        if item.payload.get("fan"):
            enqueue("echo", {"child": True})
            enqueue("nobody-handles-this", {"n": 1})

    monkeypatch.setitem(registry._handlers, "echo", fans_out)
    with txqueue.inline():
        enqueue("echo", {"fan": True})
    assert txqueue.enqueued("echo", status=Status.DONE) == txqueue.enqueued("echo")
    assert len(txqueue.enqueued("echo")) == 2
    txqueue.assert_enqueued("nobody-handles-this", count=1, status=Status.READY)
    enqueue("echo", {"after": True})  # the block is over: enqueued, not run
    txqueue.assert_enqueued("echo", {"after": True}, status=Status.READY)


class TestInsideATestCase(TestCase):
    """The helpers see the test's uncommitted rows, and the handlers' writes roll back
    with the test."""

    def test_booking_a_seat_enqueues_one_sms_and_draining_sends_it(self):
        book_seat(3)
        helpers.assert_enqueued("echo", {"seat": 3, "broken": False}, count=1)
        self.assertEqual(helpers.drain("echo").counts, {"done": 1})
        self.assertEqual(Run.objects.count(), 1)

    def test_inline_runs_the_handler_inside_the_test_transaction(self):
        with helpers.inline():
            book_seat(4)
        helpers.assert_enqueued("echo", {"seat": 4, "broken": False}, status=Status.DONE)
        self.assertEqual(Run.objects.count(), 1)

    def test_an_enqueue_on_commit_is_seen_once_the_callbacks_run(self):
        with self.captureOnCommitCallbacks(execute=True):
            transaction.on_commit(lambda: enqueue("echo", {"later": True}))
            helpers.assert_not_enqueued("echo")  # not yet: the transaction has not ended
        helpers.assert_enqueued("echo", {"later": True})
