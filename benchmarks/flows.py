"""What flows cost (docs/flows.md), each beside its plain baseline, in the same run:

    TXQUEUE_TEST_DB=postgresql python -m benchmarks.flows [STEPS] [ROUNDS] [BATCH]

- drain: a group of STEPS steps with a ``then`` (default 10,000), drained by one burst
  ``Worker`` claiming BATCH at a time (default 10), beside STEPS independent items;
  items per second, medians of ROUNDS pairs (default 3), each pair run back to back (the
  two taking turns at going first), and the median of the pairs' ratios: the machine's
  pace drifts over seconds by more than the two differ;
- release: how long after the last step's acknowledgement its ``then`` was claimed
  (``finished_at`` to ``claimed_at``, both by the database's clock), p50 and p95 over
  ROUNDS x 10 groups of 20 steps drained by one consumer;
- enqueue: writing a group of 1,000 steps with a ``then``, beside ``enqueue_many`` of
  1,000; milliseconds, medians of ROUNDS x 10 pairs, each pair run back to back (the two
  taking turns at going first), and the median of the pairs' ratios: a commit's fsync
  varies more from one to the next than the two differ.

Run by hand on its own database (``txqueue_bench_flows``), never by pytest; it prints
numbers and asserts nothing a noisy machine could fail.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
from benchmarks.database import prepare_database  # noqa: E402

prepare_database(os.environ.get("TXQUEUE_TEST_DB", "sqlite"), "txqueue_bench_flows")

from django.db import connection  # noqa: E402
from django.db.models import Max  # noqa: E402

from django_txqueue import Queue, group, step  # noqa: E402
from django_txqueue.consumer.worker import Worker  # noqa: E402
from django_txqueue.models import QueueDependency, QueueItem  # noqa: E402

QUEUE = "bench-flows"
BATCH = int(sys.argv[3]) if len(sys.argv) > 3 else 10


def empty() -> None:
    """Delete every item and edge; on PostgreSQL VACUUM them too, which autovacuum would
    do if it ran: off (as on the CI machine's server), each drain's dead rows stayed,
    and every later drain read past all of them (1.8 M after a morning's runs)."""
    QueueItem.objects.all().delete()
    QueueDependency.objects.all().delete()
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            for model in (QueueItem, QueueDependency):
                cursor.execute(f"VACUUM {connection.ops.quote_name(model._meta.db_table)}")


def drain() -> float:
    """Seconds for one burst Worker to drain the queue."""
    began = time.perf_counter()
    Worker({QUEUE: lambda item: None}, batch=BATCH, burst=True).run()
    return time.perf_counter() - began


def drain_rates(steps: int, first: str) -> tuple[float, float]:
    """Items per second: STEPS plain items, and a group of STEPS steps and its then, the
    one named ``first`` ("plain" or "group") first (the pairs take turns)."""

    def plain() -> float:
        Queue(QUEUE).enqueue_many([{"n": n} for n in range(steps)])
        return steps / drain()

    def flow() -> float:
        group(*(step(QUEUE, {"n": n}) for n in range(steps)), then=step(QUEUE, {})).enqueue()
        return (steps + 1) / drain()

    rates = in_turns({"plain": plain, "group": flow}, first)
    return rates["plain"], rates["group"]


def release_delays(groups: int) -> list[float]:
    """Milliseconds from each group's last step acknowledged to its then claimed."""
    delays = []
    for _ in range(groups):
        empty()
        items = group(*(step(QUEUE, {"n": n}) for n in range(20)), then=step(QUEUE, {})).enqueue()
        drain()
        steps = QueueItem.objects.filter(pk__in=[i.pk for i in items.items[:-1]])
        last_ack = steps.aggregate(last=Max("finished_at"))["last"]
        claimed = QueueItem.objects.get(pk=items.items[-1].pk).claimed_at
        delays.append((claimed - last_ack).total_seconds() * 1000)
    return delays


def enqueue_times(size: int, first: str) -> tuple[float, float]:
    """Milliseconds: enqueue_many of SIZE and a group of SIZE steps with a then, the one
    named ``first`` ("many" or "group") first (the pairs take turns)."""

    def many() -> float:
        began = time.perf_counter()
        Queue(QUEUE).enqueue_many([{"n": n} for n in range(size)])
        return (time.perf_counter() - began) * 1000

    def flow() -> float:
        began = time.perf_counter()
        group(*(step(QUEUE, {"n": n}) for n in range(size)), then=step(QUEUE, {})).enqueue()
        return (time.perf_counter() - began) * 1000

    took = in_turns({"many": many, "group": flow}, first)
    return took["many"], took["group"]


def in_turns(runs: dict[str, Callable[[], float]], first: str) -> dict[str, float]:
    """What each of ``runs`` measured, each on emptied tables, the one named ``first``
    first and the other after it."""
    measured = {}
    for name in sorted(runs, key=lambda name: name != first):
        empty()
        measured[name] = runs[name]()
    return measured


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    vendor = os.environ.get("TXQUEUE_TEST_DB", "sqlite")
    rates = [drain_rates(steps, ("plain", "group")[n % 2]) for n in range(rounds)]
    plain, flow = (statistics.median(r[n] for r in rates) for n in (0, 1))
    share = statistics.median(group / plain for plain, group in rates)
    print(f"{vendor}, load {os.getloadavg()[0]:.2f}")
    print(
        f"drain, {steps:,} items, batch {BATCH}: plain {plain:,.0f}/s, "
        f"a group with a then {flow:,.0f}/s (medians of {rounds}; the median pair {share:.0%})"
    )
    delays = sorted(release_delays(rounds * 10))
    p95 = delays[max(0, round(len(delays) * 0.95) - 1)]
    print(
        f"then claimed after the last step's acknowledgement: p50 "
        f"{statistics.median(delays):.1f} ms, p95 {p95:.1f} ms ({len(delays)} groups)"
    )
    times = [enqueue_times(1000, ("many", "group")[n % 2]) for n in range(rounds * 10)]
    many, flows = (statistics.median(t[n] for t in times) for n in (0, 1))
    ratio = statistics.median(group / many for many, group in times)
    print(
        f"enqueue 1,000: enqueue_many {many:.1f} ms, a group with a then {flows:.1f} ms "
        f"(medians of {len(times)}; the median pair {ratio:.2f}x)"
    )
    empty()


if __name__ == "__main__":
    main()
