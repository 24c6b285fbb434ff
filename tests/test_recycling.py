"""Recycling (docs/limits.md): ``run_queue_consumer --max-items N --max-memory MB
--max-age SECONDS``: the process stops claiming, runs what it holds, exits 0, and under
``--processes`` its supervisor starts another; nothing is released or lost."""

import subprocess
import sys
import time

import pytest
from django.core.management import CommandError, call_command

from django_txqueue import Status
from django_txqueue.consumer import recycling
from django_txqueue.consumer.recycling import RECYCLE_FD, Recycling, resident_mb
from django_txqueue.consumer.supervisor import Supervisor
from django_txqueue.consumer.worker import Worker
from django_txqueue.observe import metrics

pytestmark = pytest.mark.django_db(transaction=True)


def statuses(queue):
    """{status: (count, {attempts})} of the queue's items."""
    found = {}
    for status, attempts in queue.items.values_list("status", "attempts"):
        count, seen = found.get(status, (0, set()))
        found[status] = (count + 1, seen | {attempts})
    return found


def test_max_items_caps_the_claims_and_runs_every_item_claimed(queue):
    queue.enqueue_many([{"n": n} for n in range(30)])
    worker = Worker(
        {queue.name: lambda item: None},
        batch=5,
        burst=True,  # broken, it would drain all 30: the assertions tell, nothing hangs
        recycling=Recycling(max_items=12),
    )
    assert worker.run() == 0
    assert worker.recycled.startswith("max-items: claimed 12 items")
    assert worker.processed == 12
    # Nothing released: the 18 never claimed wait, never tried.
    assert statuses(queue) == {Status.DONE: (12, {1}), Status.READY: (18, {0})}


def test_max_age_finishes_what_it_holds_and_releases_nothing(queue):
    queue.enqueue_many([{"n": n} for n in range(200)])
    worker = Worker(
        {queue.name: lambda item: time.sleep(0.01)},
        batch=5,
        burst=True,
        recycling=Recycling(max_age=0.3),
    )
    began = time.monotonic()
    assert worker.run() == 0
    assert time.monotonic() - began < 5
    assert worker.recycled.startswith("max-age")
    found = statuses(queue)
    assert set(found) == {Status.DONE, Status.READY}
    assert found[Status.DONE][1] == {1} and found[Status.READY][1] == {0}


def test_max_memory_with_a_leaking_handler(queue, monkeypatch):
    monkeypatch.setattr(recycling, "MEMORY_CHECK_INTERVAL", 0)
    leaked = []
    queue.enqueue_many([{"n": n} for n in range(40)])
    worker = Worker(
        {queue.name: lambda item: leaked.append(bytearray(5 * 2**20))},
        batch=2,
        burst=True,
        recycling=Recycling(max_memory_mb=resident_mb() + 50),
    )
    try:
        assert worker.run() == 0
    finally:
        leaked.clear()
    assert worker.recycled.startswith("max-memory")
    found = statuses(queue)
    assert 8 <= found[Status.DONE][0] < 40  # about 10 x 5 MB, then it stopped claiming
    assert found[Status.DONE][1] == {1} and found[Status.READY][1] == {0}


def test_a_recycle_is_counted_in_the_metrics(queue):
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    metrics.enable(registry)
    try:
        queue.enqueue_many([{}] * 4)
        Worker({queue.name: lambda item: None}, burst=True, recycling=Recycling(max_items=2)).run()
    finally:
        metrics.recorder = None
    found = registry.get_sample_value("txqueue_consumer_recycles_total", {"reason": "max-items"})
    assert found == 1


def test_without_a_limit_nothing_recycles(queue):
    queue.enqueue_many([{}] * 5)
    worker = Worker({queue.name: lambda item: None}, burst=True)
    assert worker.run() == 0
    assert worker.recycled is None


@pytest.mark.parametrize(
    "option", [("--max-items", "0"), ("--max-memory", "-5"), ("--max-age", "nan")]
)
def test_limits_must_be_positive(option):
    with pytest.raises(CommandError, match=option[0].lstrip("-").replace("-", "[-_]")):
        call_command("run_queue_consumer", "echo", "--burst", *option)


def exits_0(written=""):
    """A child that writes ``written`` to the recycle pipe, then exits 0."""
    code = f"import os; os.write(int(os.environ[{RECYCLE_FD!r}]), {written.encode()!r}) or 0"
    return [sys.executable, "-c", code]


@pytest.mark.slow
class TestSupervisor:
    def finished(self, watched):
        child, born = watched.spawn()
        child.wait(timeout=30)
        return child, born

    def test_a_child_that_recycled_is_replaced_at_once(self):
        watched = Supervisor(exits_0("max-items: claimed 100 items"), 1)
        began = time.monotonic()
        replacement, _ = watched.check(*self.finished(watched))
        assert time.monotonic() - began < 5  # no restart pause
        assert isinstance(replacement, subprocess.Popen)
        assert watched.recycles == 1
        replacement.wait(timeout=30)

    def test_a_child_that_exits_0_without_recycling_is_done(self):
        watched = Supervisor(exits_0(), 1)
        assert watched.check(*self.finished(watched)) is None
        assert watched.recycles == 0 and watched.pipes == {}

    def test_each_running_child_has_its_pipe_and_no_other(self):
        watched = Supervisor(exits_0("max-age: ran 60 s"), 1)
        child, born = self.finished(watched)
        assert list(watched.pipes) == [child.pid]
        replacement, _ = watched.check(child, born)
        assert list(watched.pipes) == [replacement.pid]  # the exited child's closed
        replacement.wait(timeout=30)
