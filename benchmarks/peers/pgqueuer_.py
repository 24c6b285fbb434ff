"""pgqueuer: asyncio, batch claims (``batch_size``), LISTEN/NOTIFY. Its workers use the
asyncpg driver, the faster of its two by its own benchmark (here its psycopg driver added
about 4 s to every worker's run, spent in the idle check before a drain-mode exit); jobs are
enqueued through its synchronous psycopg driver."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import asyncpg
import psycopg
from pgqueuer.db import AsyncpgDriver, SyncPsycopgDriver
from pgqueuer.qm import QueueManager
from pgqueuer.queries import Queries, SyncQueries
from pgqueuer.types import QueueExecutionMode

from .common import (
    Drained,
    connection_url,
    conninfo,
    execute,
    fork_drain,
    record,
    wakeup_latencies,
)

NAME = "pgqueuer"
BATCH = 10
ENQUEUE_CHUNK = 5000


async def _install() -> None:
    connection = await asyncpg.connect(connection_url())
    try:
        await Queries(AsyncpgDriver(connection)).install()
    finally:
        await connection.close()


def prepare() -> None:
    asyncio.run(_install())


def _clear() -> None:
    execute("TRUNCATE pgqueuer, pgqueuer_log, pgqueuer_statistics")


async def _work(mode: QueueExecutionMode) -> None:
    connection = await asyncpg.connect(connection_url())
    try:
        manager = QueueManager(Queries(AsyncpgDriver(connection)))

        @manager.entrypoint("noop")
        async def noop(job):  # type: ignore[no-untyped-def]
            record(int(job.payload))

        await manager.run(batch_size=BATCH, mode=mode)
    finally:
        await connection.close()


def _drain_until_empty() -> None:
    asyncio.run(_work(QueueExecutionMode.drain))


def _run_forever() -> None:
    asyncio.run(_work(QueueExecutionMode.continuous))


def drain(items: int, processes: int) -> Drained:
    _clear()
    with psycopg.connect(conninfo(), autocommit=True) as connection:
        queries = SyncQueries(SyncPsycopgDriver(connection))
        for first in range(0, items, ENQUEUE_CHUNK):
            numbers = range(first, min(first + ENQUEUE_CHUNK, items))
            queries.enqueue(
                ["noop"] * len(numbers), [str(n).encode() for n in numbers], [0] * len(numbers)
            )
    execute("VACUUM ANALYZE pgqueuer")
    result = fork_drain(_drain_until_empty, items, processes)
    # pgqueuer deletes a finished job; none may be left in its queue table.
    (left,) = execute("SELECT count(*) FROM pgqueuer")[0]
    if left:
        result.problems.append(f"{left} job(s) left in pgqueuer's queue table")
    _clear()
    return result


@contextmanager
def enqueuer() -> Iterator[Callable[[int], float]]:
    """Its ``enqueue()`` through its synchronous psycopg driver, in autocommit: each job
    committed on return. Its table is emptied before and after."""
    _clear()
    with _producer() as enqueue_one:
        yield enqueue_one
    _clear()


@contextmanager
def _producer() -> Iterator[Callable[[int], float]]:
    with psycopg.connect(conninfo(), autocommit=True) as connection:
        queries = SyncQueries(SyncPsycopgDriver(connection))

        def enqueue_one(n: int) -> float:
            queries.enqueue("noop", str(n).encode())  # autocommit: committed on return
            return time.time()

        yield enqueue_one


def wakeup(samples: int) -> list[float]:
    _clear()
    latencies = wakeup_latencies(_run_forever, _producer, samples)
    _clear()
    return latencies
