"""A flow's fan-in under real consumer processes (docs/flows.md): a group of 2,000 steps
with a ``then``, drained by four ``run_queue_consumer --concurrency 2`` processes. The
``then`` item is released once, after the last step's acknowledgement, and runs once;
so too when consumers are SIGKILLed mid-drain (their steps are rescued and run again)."""

import signal

import pytest
from django.db.models import Max

from django_txqueue import Status, group, step
from django_txqueue.models import QueueItem
from tests.helpers import runs_per_item

from .test_consumer_processes import consumers, stderr_of, wait_for  # noqa: F401 - fixture

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

STEPS = 2000


def fan_in():
    """The group, its steps and its ``then`` on queue "echo", whose handler records each
    run (tests/testapp/queues.py)."""
    flow = group(*(step("echo", {"n": n}) for n in range(STEPS)), then=step("echo", {})).enqueue()
    return flow.items[:-1], flow.items[-1]


def done(items):
    return QueueItem.objects.filter(pk__in=[i.pk for i in items], status=Status.DONE).count()


def assert_released_once_after_the_last_step(steps, then):
    runs = runs_per_item()
    then_row = QueueItem.objects.get(pk=then.pk)
    assert then_row.status == Status.DONE
    assert runs[then.pk] == 1  # released once: it ran once
    assert then_row.attempts == 1
    last_ack = QueueItem.objects.filter(pk__in=[s.pk for s in steps]).aggregate(
        last=Max("finished_at")
    )["last"]
    assert then_row.claimed_at >= last_ack  # not before the last step's acknowledgement
    assert then_row.waiting_for == 0
    assert done(steps) == STEPS
    assert all(runs.get(s.pk, 0) >= 1 for s in steps)


def test_four_consumers_release_the_then_item_once(consumers):  # noqa: F811
    steps, then = fan_in()
    # No consumer taken for dead while SQLite's writers queue up: each step runs once.
    procs = [consumers("echo", "--concurrency", "2", CONSUMER_TIMEOUT=60) for _ in range(4)]
    wait_for(
        lambda: QueueItem.objects.filter(pk=then.pk, status=Status.DONE).exists(),
        120,
        "the then item done",
        procs,
    )
    runs = runs_per_item()
    twice = {s.pk: runs.get(s.pk) for s in steps if runs.get(s.pk) != 1}
    assert twice == {}, "each step ran once"
    assert_released_once_after_the_last_step(steps, then)


def test_killed_consumers_still_release_the_then_item_once(consumers):  # noqa: F811
    steps, then = fan_in()
    procs = [consumers("echo", "--concurrency", "2") for _ in range(4)]
    wait_for(lambda: done(steps) >= STEPS // 4, 120, "a quarter of the steps done", procs)
    for proc in procs[:2]:
        proc.send_signal(signal.SIGKILL)  # mid-batch: their claimed steps are rescued
        proc.wait(timeout=10)
    procs += [consumers("echo", "--concurrency", "2") for _ in range(2)]
    wait_for(
        lambda: QueueItem.objects.filter(pk=then.pk, status=Status.DONE).exists(),
        180,
        "the then item done after the kills",
        procs,
    )
    assert_released_once_after_the_last_step(steps, then)
