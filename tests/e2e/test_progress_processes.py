"""Progress read from another process while a ``run_queue_consumer`` process's handler
runs: the reports appear as it goes, and the last one stays when it is done."""

import pytest

from django_txqueue import Queue, Status
from django_txqueue.models import QueueItem
from tests.e2e.test_consumer_processes import START_TIMEOUT, consumers, exit_code, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

__all__ = ["consumers"]  # the fixture, shared with the other process tests


def test_progress_is_read_from_another_process_while_the_handler_runs(consumers):
    item = Queue("progress").enqueue({"steps": 4, "pause": 0.6})
    proc = consumers("progress", "--concurrency", "1")
    seen = []

    def reported():
        stored = QueueItem.objects.get(pk=item.pk)
        report = stored.progress if stored.status == Status.IN_PROGRESS else None
        if report is not None and report not in seen:
            seen.append(report)
        return stored.status == Status.DONE

    wait_for(reported, START_TIMEOUT, "the handler's end", [proc])
    # Several of its steps seen while it ran, in order, from this process.
    assert len(seen) >= 2, seen
    assert [report["done"] for report in seen] == sorted(report["done"] for report in seen)
    assert all(report["total"] == 4 for report in seen)
    assert QueueItem.objects.get(pk=item.pk).progress == {
        "done": 4,
        "total": 4,
        "message": "all steps",
    }
    proc.terminate()
    assert exit_code(proc, 15) == 0
