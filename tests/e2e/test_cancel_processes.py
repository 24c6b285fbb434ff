"""Cancellation with real consumer processes (``run_queue_consumer``): a running handler
learns of the request with its consumer's heartbeat and its item ends CANCELLED; an asked
item whose consumer dies is rescued CANCELLED by another, never run again."""

import time

import pytest

from django_txqueue import Queue, Status
from django_txqueue.models import QueueItem
from tests.e2e.test_consumer_processes import START_TIMEOUT, consumers, exit_code, wait_for
from tests.testapp.models import Run

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

__all__ = ["consumers"]  # the fixture, shared with the other process tests


def test_a_running_handler_is_asked_to_stop_and_its_item_ends_cancelled(consumers):
    item = Queue("cancellable").enqueue({"seconds": 30})
    waiting = Queue("cancellable").enqueue({"seconds": 30})
    proc = consumers("cancellable", "--concurrency", "1", "--batch", "1")
    started = Run.objects.filter(item_id=item.pk)
    wait_for(started.exists, START_TIMEOUT, "the run", [proc])
    asked_at = time.monotonic()
    assert Queue("cancellable").cancel() == 2  # the running one asked, the waiting one ended
    assert QueueItem.objects.get(pk=waiting.pk).status == Status.CANCELLED
    wait_for(
        lambda: QueueItem.objects.get(pk=item.pk).status == Status.CANCELLED,
        5,
        "the cancelled item",
        [proc],
    )
    # Within a heartbeat (0.2 s here) and the acknowledgement's turn, not the 30 s of work.
    assert time.monotonic() - asked_at < 3
    stored = QueueItem.objects.get(pk=item.pk)
    assert (stored.result, stored.attempts) == ("stopped", 1)
    assert not Run.objects.filter(item_id=waiting.pk).exists()  # never claimed
    proc.terminate()
    assert exit_code(proc, 15) == 0


def test_an_asked_item_whose_consumer_died_is_rescued_cancelled(consumers):
    """The handler ignores nothing here: its consumer is killed before the request, so
    only the rescue can settle it, and it must not run it again."""
    item = Queue("slow").enqueue({"seconds": 30})
    victim = consumers("slow", "--lease", "1")
    wait_for(lambda: Run.objects.exists(), START_TIMEOUT, "the run", [victim])
    victim.kill()
    victim.wait(timeout=10)
    assert QueueItem.objects.get(pk=item.pk).cancel() is True
    rescuer = consumers("slow", "--lease", "1")
    wait_for(
        lambda: QueueItem.objects.get(pk=item.pk).status == Status.CANCELLED,
        START_TIMEOUT,
        "the rescue",
        [rescuer],
    )
    time.sleep(0.5)
    assert Run.objects.filter(item_id=item.pk).count() == 1  # never run again
    assert QueueItem.objects.get(pk=item.pk).attempts == 1
