"""``async def`` handlers in ``run_queue_consumer`` processes: SIGTERM mid-drain lets the
running coroutines finish and exits 0, with nothing lost and nothing run twice."""

import signal

import pytest

from django_txqueue import Queue, Status
from tests.e2e.test_consumer_processes import START_TIMEOUT, consumers, exit_code, wait_for
from tests.helpers import runs_per_item

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

__all__ = ["consumers"]  # the fixture, shared with the other process tests


def test_sigterm_mid_drain_finishes_the_running_coroutines_and_loses_nothing(consumers):
    queue = Queue("async-nap")
    items = queue.enqueue_many([{"seconds": 0.2} for _ in range(300)])
    first = consumers("async-nap", "--concurrency", "20")
    wait_for(lambda: queue.count(Status.DONE) >= 40, START_TIMEOUT, "a part drained", [first])
    first.send_signal(signal.SIGTERM)
    assert exit_code(first, 15) == 0
    # What it had claimed and not started went back READY; what ran finished.
    assert queue.count(Status.IN_PROGRESS) == 0
    left = queue.count(Status.READY)
    assert 0 < left < 300 - 40
    second = consumers("async-nap", "--concurrency", "50", "--burst")
    assert exit_code(second, 60) == 0
    assert queue.count(Status.DONE) == 300
    runs = runs_per_item()
    assert {item.pk for item in items} == set(runs) and set(runs.values()) == {1}
    assert set(queue.items.values_list("result", flat=True)) == {"napped"}
