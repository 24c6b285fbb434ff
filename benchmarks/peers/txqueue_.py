"""django-txqueue, through ``manage.py txqueue_bench``'s own workloads (its drain, with its
exactly-once check, and its idle-consumer wake-up)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from django_txqueue import Queue
from django_txqueue.consumer import wakeup as local_wakeup
from django_txqueue.contrib.bench import drain as bench_drain
from django_txqueue.contrib.bench import wakeup as bench_wakeup
from django_txqueue.contrib.progress import Progress
from django_txqueue.contrib.target import Target

from .common import WARM_UP, Drained

NAME = "django-txqueue"
BATCH = 10
TARGET = Target(alias="default", queue="peers-bench")


def prepare() -> None:
    """Its tables come with the Django migrations the runner applies."""


def drain(items: int, processes: int) -> Drained:
    # Forked Workers, as the peers' workers are forked (not run_queue_consumer processes).
    return drain_forked("inprocess", items, processes)


def drain_forked(mode: str, items: int, processes: int) -> Drained:
    """``txqueue_bench``'s drain with forked consumers: ``Worker``s (``inprocess``) or
    its hand-written loop (``by hand``)."""
    drained = bench_drain.drain_once(
        TARGET,
        bench_drain.starter(TARGET, BATCH, "skip_locked", processes, mode),
        items=items,
        processes=processes,
        progress=Progress(None),
        label=f"{NAME} ({mode})",
    )
    return Drained(drained.rate, drained.problems)


@contextmanager
def enqueuer() -> Iterator[Callable[[int], float]]:
    """``enqueue()`` in autocommit: one statement, a transaction of its own, as the
    peers' enqueues commit on return (in a caller's ``atomic()`` it adds no statement
    of its own; BEGIN and COMMIT are the caller's). Its queue emptied before and after."""
    TARGET.clear()
    queue = Queue(TARGET.queue)

    def enqueue_one(n: int) -> float:
        queue.enqueue({"n": n})
        return time.time()

    yield enqueue_one
    TARGET.clear()


def wakeup(samples: int) -> list[float]:
    TARGET.clear()
    consumer = bench_wakeup.IdleConsumer(TARGET)
    try:
        bench_wakeup.latencies(TARGET, WARM_UP)
        # Producers look consumers up once a second: past that, this one is known to all.
        time.sleep(local_wakeup.ADDRESS_CACHE_SECONDS)
        return bench_wakeup.latencies(TARGET, samples)
    finally:
        consumer.stop()
        TARGET.clear()
