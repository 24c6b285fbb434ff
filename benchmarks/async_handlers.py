"""Handlers that wait on I/O: ``async def`` ones on the consumer's event loop beside sync
ones on its threads (docs/async.md), in the same run:

    TXQUEUE_TEST_DB=postgresql python -m benchmarks.async_handlers \\
        [ITEMS] [SECONDS] [CONCURRENCY] [ROUNDS]

ITEMS (default 1,000) items whose handler waits SECONDS (default 0.05: a provider's API
call), drained by one burst consumer (``Worker``, what ``run_queue_consumer --burst
--concurrency CONCURRENCY`` runs, default 100): once with an ``async def`` handler that
awaits ``asyncio.sleep``, once with a sync one that calls ``time.sleep`` on the threads,
taking turns ROUNDS times (default 3). Prints the drain's seconds and items per second,
the medians, and the floor (ITEMS x SECONDS / CONCURRENCY).

Run by hand on its own database (``txqueue_bench_async``), never by pytest; it prints
numbers and asserts nothing a noisy machine could fail.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
from benchmarks.database import prepare_database  # noqa: E402

prepare_database(os.environ.get("TXQUEUE_TEST_DB", "sqlite"), "txqueue_bench_async")

from django_txqueue import Queue, Status  # noqa: E402
from django_txqueue.consumer.worker import Worker  # noqa: E402


def drain(items: int, seconds: float, concurrency: int, coroutines: bool) -> float:
    """Seconds for one burst consumer to drain ``items`` handlers of ``seconds`` each."""
    queue = Queue("bench-async" if coroutines else "bench-threads")
    queue.items.all().delete()
    queue.enqueue_many([{"n": n} for n in range(items)])

    async def wait_async(item: object) -> None:
        await asyncio.sleep(seconds)

    def wait_sync(item: object) -> None:
        time.sleep(seconds)

    handle = wait_async if coroutines else wait_sync
    began = time.monotonic()
    Worker({queue.name: handle}, concurrency=concurrency, burst=True).run()
    took = time.monotonic() - began
    done = queue.count(Status.DONE)
    if done != items:
        sys.exit(f"{queue.name}: {done} of {items} items done")
    return took


def main() -> None:
    given = sys.argv[1:]
    items = int(given[0]) if len(given) > 0 else 1000
    seconds = float(given[1]) if len(given) > 1 else 0.05
    concurrency = int(given[2]) if len(given) > 2 else 100
    rounds = int(given[3]) if len(given) > 3 else 3
    taken: dict[str, list[float]] = {"async def (event loop)": [], "sync (threads)": []}
    for _ in range(rounds):
        for name, coroutines in (("async def (event loop)", True), ("sync (threads)", False)):
            taken[name].append(drain(items, seconds, concurrency, coroutines))
    vendor = os.environ.get("TXQUEUE_TEST_DB", "sqlite")
    floor = items * seconds / concurrency
    print(
        f"{vendor}: {items:,} handlers waiting {seconds * 1000:g} ms each, "
        f"--concurrency {concurrency}, medians of {rounds} (floor {floor:.2f} s)"
    )
    print(f"{'handlers':<24}{'seconds':>10}{'items/s':>10}   each run")
    for name, runs in taken.items():
        median = statistics.median(runs)
        each = ", ".join(f"{run:.2f}" for run in runs)
        print(f"{name:<24}{median:>10.2f}{items / median:>10,.0f}   {each}")


if __name__ == "__main__":
    main()
