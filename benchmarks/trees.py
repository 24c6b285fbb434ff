"""The consumer's drain in two source trees, alternating: what a change did to it.

    python -m benchmarks.trees BEFORE_TREE AFTER_TREE [BATCH] [ITEMS] [ROUNDS]

Each round drains ITEMS no-op items (default 20,000, batch 10) with one in-process burst
``Worker`` in a fresh interpreter run from each tree (its own ``django_txqueue``), the
order alternating round by round, on the database ``TXQUEUE_TEST_DB`` names (its own,
``txqueue_bench_cpu``; ``STRATEGY`` picks the claim strategy). Prints each tree's median
rate and CPU per item of the consumer's process, and every round's rate. Both trees must
have ``benchmarks/database.py`` and the same migrations.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys

DRAIN = r"""
import os, sys, time
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
from benchmarks.database import prepare_database
prepare_database(os.environ["TXQUEUE_TEST_DB"], "txqueue_bench_cpu")
from django_txqueue import Queue
from django_txqueue.db import dialect_for
from django_txqueue.models import QueueItem
from django_txqueue.worker import Worker
items, batch = int(sys.argv[1]), int(sys.argv[2])
QueueItem.objects.all().delete()
for start in range(0, items, 5000):
    Queue("bench-cpu").enqueue_many([{"n": n} for n in range(start, min(items, start + 5000))])
dialect_for("default").analyze(QueueItem.objects.all())
worker = Worker(handlers={"bench-cpu": lambda item: None}, batch=batch, burst=True,
                strategy=os.environ.get("STRATEGY", "auto"))
wall, cpu = time.perf_counter(), time.process_time()
worker.run()
assert worker.processed == items, worker.processed
print(items / (time.perf_counter() - wall), (time.process_time() - cpu) / items * 1e6)
"""


def drain(tree: str, items: int, batch: int) -> tuple[float, float]:
    env = dict(os.environ, PYTHONPATH=tree)
    env.setdefault("TXQUEUE_TEST_DB", "postgresql")
    done = subprocess.run(
        [sys.executable, "-c", DRAIN, str(items), str(batch)],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    rate, cpu = done.stdout.split()[-2:]
    return float(rate), float(cpu)


def main() -> None:
    before, after = sys.argv[1:3]
    given = [int(arg) for arg in sys.argv[3:6]]
    batch, items, rounds = given + [10, 20_000, 6][len(given) :]
    found: dict[str, list[tuple[float, float]]] = {"before": [], "after": []}
    for round_ in range(rounds):
        order = [("before", before), ("after", after)]
        for name, tree in order if round_ % 2 == 0 else reversed(order):
            found[name].append(drain(tree, items, batch))
    print(f"batch {batch}, {items:,} items, {rounds} rounds, load {os.getloadavg()[0]:.2f}")
    for name, runs in found.items():
        rate = statistics.median(r for r, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        every = ", ".join(f"{r:,.0f}" for r, _ in runs)
        print(f"  {name:6} {rate:8,.0f} items/s  {cpu:6.1f} µs CPU per item  ({every})")


if __name__ == "__main__":
    main()
