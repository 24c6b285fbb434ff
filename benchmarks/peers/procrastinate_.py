"""procrastinate: psycopg 3 connector, one job per fetch (no batch claim), LISTEN/NOTIFY."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from procrastinate import App, PsycopgConnector

from .common import (
    Drained,
    conninfo,
    execute,
    fork_drain,
    record,
    wakeup_latencies,
)

NAME = "procrastinate"
BATCH = 1  # procrastinate fetches one job at a time
ENQUEUE_CHUNK = 5000
QUEUE = "peers"

app = App(connector=PsycopgConnector(conninfo=conninfo()))


@app.task(name="noop", queue=QUEUE)
def noop(n: int) -> None:
    record(n)


def prepare() -> None:
    with app.open():
        app.schema_manager.apply_schema()


def _clear() -> None:
    execute("TRUNCATE procrastinate_jobs CASCADE")


def _drain_until_empty() -> None:
    # wait=False: the worker returns once the queue is empty.
    app.run_worker(queues=[QUEUE], wait=False, concurrency=1)


def _run_forever() -> None:
    app.run_worker(queues=[QUEUE], concurrency=1)


def drain(items: int, processes: int) -> Drained:
    _clear()
    with app.open():
        for first in range(0, items, ENQUEUE_CHUNK):
            noop.batch_defer(*({"n": n} for n in range(first, min(first + ENQUEUE_CHUNK, items))))
    execute("VACUUM ANALYZE procrastinate_jobs")
    result = fork_drain(_drain_until_empty, items, processes)
    (succeeded,) = execute("SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'")[0]
    if succeeded != items:
        result.problems.append(f"{succeeded} job(s) succeeded in its table, not {items}")
    _clear()
    return result


@contextmanager
def _producer() -> Iterator[Callable[[int], float]]:
    with app.open():

        def enqueue_one(n: int) -> float:
            noop.defer(n=n)  # its own transaction: committed on return
            return time.time()

        yield enqueue_one


@contextmanager
def enqueuer() -> Iterator[Callable[[int], float]]:
    """Its ``defer()``, each job in a transaction of its own; its table emptied before
    and after."""
    _clear()
    with _producer() as enqueue_one:
        yield enqueue_one
    _clear()


def wakeup(samples: int) -> list[float]:
    _clear()
    latencies = wakeup_latencies(_run_forever, _producer, samples)
    _clear()
    return latencies
