"""``async def`` handlers in ``run_queue_consumer`` processes, beside sync ones: SIGTERM
mid-drain lets the running coroutines and threads finish and exits 0, with nothing lost and
nothing run twice."""

import signal

import pytest

from django_txqueue import Queue, Status
from django_txqueue.models import QueueItem
from tests.e2e.test_consumer_processes import START_TIMEOUT, consumers, exit_code, wait_for
from tests.helpers import runs_per_item

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

__all__ = ["consumers"]  # the fixture, shared with the other process tests

QUEUES = ("async-nap", "nap")


def test_sigterm_mid_drain_finishes_what_runs_and_loses_nothing(consumers):
    items = [
        item
        for name in QUEUES
        for item in Queue(name).enqueue_many([{"seconds": 0.2} for _ in range(150)])
    ]
    done = QueueItem.objects.filter(queue__in=QUEUES, status=Status.DONE)
    first = consumers(*QUEUES, "--concurrency", "10")
    wait_for(
        lambda: done.filter(queue="async-nap").count() >= 20, START_TIMEOUT, "a part", [first]
    )
    wait_for(lambda: done.filter(queue="nap").count() >= 20, START_TIMEOUT, "a part", [first])
    first.send_signal(signal.SIGTERM)
    assert exit_code(first, 15) == 0
    # What it had claimed and not started went back READY; what ran finished.
    assert not QueueItem.objects.filter(queue__in=QUEUES, status=Status.IN_PROGRESS).exists()
    assert 0 < QueueItem.objects.filter(queue__in=QUEUES, status=Status.READY).count() < 260
    second = consumers(*QUEUES, "--concurrency", "50", "--burst")
    assert exit_code(second, 60) == 0
    assert done.count() == 300
    runs = runs_per_item()
    assert {item.pk for item in items} == set(runs) and set(runs.values()) == {1}
    assert set(done.values_list("result", flat=True)) == {"napped"}
