"""What a rate limit costs a queue whose budget is above its drain rate (docs/limits.md),
beside the same queue unlimited, in the same run:

    TXQUEUE_TEST_DB=postgresql python -m benchmarks.limits [ITEMS] [ROUNDS] [BATCH]

ITEMS (default 10,000) no-op items drained by one burst ``Worker`` (one thread, batch
BATCH, default 10) from a queue without limits, then from the same queue with
``RATE_LIMIT`` "1000000/s", then with ``RATE_LIMIT_PER_KEY`` "1000000/s" (the items over
100 keys), taking turns ROUNDS times (default 3); items per second, the medians.

Run by hand on its own database (``txqueue_bench_limits``), never by pytest; it prints
numbers and asserts nothing a noisy machine could fail.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
from benchmarks.database import prepare_database  # noqa: E402

prepare_database(os.environ.get("TXQUEUE_TEST_DB", "sqlite"), "txqueue_bench_limits")

from django.conf import settings  # noqa: E402
from django.test.utils import override_settings  # noqa: E402

from django_txqueue import Queue  # noqa: E402
from django_txqueue.consumer.worker import Worker  # noqa: E402
from django_txqueue.models import QueueItem, QueueRate  # noqa: E402

QUEUE = "bench-limits"
ABOVE_ANY_DRAIN = "1000000/s"
SHAPES = {
    "unlimited": {},
    "RATE_LIMIT": {"RATE_LIMIT": ABOVE_ANY_DRAIN},
    "RATE_LIMIT_PER_KEY": {"RATE_LIMIT_PER_KEY": ABOVE_ANY_DRAIN},
}


def drain_rate(items: int, batch: int, options: dict[str, str]) -> float:
    """Items per second for one burst Worker to drain ITEMS items under ``options``."""
    QueueItem.objects.all().delete()
    QueueRate.objects.all().delete()
    for key in range(100):
        Queue(QUEUE).enqueue_many([{"n": n} for n in range(key, items, 100)], key=str(key))
    txqueue = {**getattr(settings, "TXQUEUE", {}), "QUEUES": {QUEUE: options}}
    with override_settings(TXQUEUE=txqueue):
        began = time.perf_counter()
        Worker({QUEUE: lambda item: None}, batch=batch, burst=True).run()
        took = time.perf_counter() - began
    assert QueueItem.objects.filter(status=1).count() == 0  # noqa: S101 - drained
    return items / took


def main() -> None:
    items = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    batch = int(sys.argv[3]) if len(sys.argv) > 3 else 10
    rates: dict[str, list[float]] = {name: [] for name in SHAPES}
    for _ in range(rounds):
        for name, options in SHAPES.items():
            rates[name].append(drain_rate(items, batch, options))
    vendor = os.environ.get("TXQUEUE_TEST_DB", "sqlite")
    print(f"{vendor}, {items:,} items, batch {batch}, load {os.getloadavg()[0]:.2f}")
    baseline = statistics.median(rates["unlimited"])
    for name, found in rates.items():
        rate = statistics.median(found)
        print(f"  {name:20} {rate:8,.0f}/s  ({rate / baseline:.0%} of unlimited)")
    QueueItem.objects.all().delete()


if __name__ == "__main__":
    main()
