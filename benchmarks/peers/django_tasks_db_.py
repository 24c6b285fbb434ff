"""django-tasks-db: Django's task framework (``django.tasks``) with its database backend;
its worker claims one task per transaction and polls (``--interval``, 1 s by default)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

from django.db import transaction
from django.tasks import task
from django_tasks_db.management.commands.db_worker import Worker
from django_tasks_db.models import DBTaskResult

from .common import Drained, fork_drain, record, wakeup_latencies

NAME = "django-tasks-db"
BATCH = 1  # one task per claim
DEFAULT_INTERVAL = 1.0  # seconds, db_worker's default poll interval


@task()
def noop(n: int) -> None:
    record(n)


def prepare() -> None:
    """Its tables come with the Django migrations the runner applies."""


def _worker(*, interval: float, until_empty: bool) -> Worker:
    return Worker(
        queue_names=["default"],
        interval=interval,
        batch=until_empty,  # "batch" here means: exit once the queue is empty
        backend_name="default",
        startup_delay=False,
        max_tasks=None,
        worker_id=uuid.uuid4().hex[:32],
        excluded_queue_names=[],
    )


def _drain_until_empty() -> None:
    _worker(interval=0, until_empty=True).run()


def _run_forever() -> None:
    _worker(interval=DEFAULT_INTERVAL, until_empty=False).run()


def drain(items: int, processes: int) -> Drained:
    DBTaskResult.objects.all().delete()
    with transaction.atomic():
        for n in range(items):
            noop.enqueue(n)
    result = fork_drain(_drain_until_empty, items, processes)
    succeeded = DBTaskResult.objects.successful().count()
    if succeeded != items:
        result.problems.append(f"{succeeded} task(s) successful in its table, not {items}")
    DBTaskResult.objects.all().delete()
    return result


def _enqueue_one(n: int) -> float:
    committed: list[float] = []
    with transaction.atomic():
        transaction.on_commit(lambda: committed.append(time.time()))
        noop.enqueue(n)
    return committed[0]


@contextmanager
def enqueuer() -> Iterator[Callable[[int], float]]:
    """Its ``enqueue()`` in autocommit: a transaction of its own, as the others'; its
    table emptied before and after."""
    DBTaskResult.objects.all().delete()

    def enqueue_one(n: int) -> float:
        noop.enqueue(n)
        return time.time()

    yield enqueue_one
    DBTaskResult.objects.all().delete()


def wakeup(samples: int) -> list[float]:
    DBTaskResult.objects.all().delete()
    # Django opens the producer's connection after the fork, on first use.
    latencies = wakeup_latencies(_run_forever, lambda: nullcontext(_enqueue_one), samples)
    DBTaskResult.objects.all().delete()
    return latencies
