"""The consumer's drain, or enqueue(), in two source trees, alternating: what a change did.

    python -m benchmarks.trees BEFORE_TREE AFTER_TREE [BATCH] [ITEMS] [ROUNDS]
    python -m benchmarks.trees BEFORE_TREE AFTER_TREE enqueue [ITEMS] [ROUNDS]

Each round drains ITEMS no-op items (default 20,000, batch 10) with one in-process burst
``Worker`` in a fresh interpreter run from each tree (its own ``django_txqueue``), the
order alternating round by round, on the database ``TXQUEUE_TEST_DB`` names (each tree
its own, ``txqueue_bench_cpu_before`` and ``_after``: their migrations may differ;
``STRATEGY`` picks the claim strategy). Prints each tree's median rate and CPU per item of
the consumer's process, and every round's rate. Both trees must have
``benchmarks/database.py``.

With ``enqueue``, each round makes ITEMS (default 2,000) ``enqueue()`` calls in autocommit
instead, one item each, after 200 to warm up, and prints the rate and the CPU per call.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys

# Both snippets start alike: the tree's settings, its own database, the queue's API.
SETUP = r"""
import os, sys, time
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
from benchmarks.database import prepare_database
prepare_database(os.environ["TXQUEUE_TEST_DB"], os.environ["TXQUEUE_BENCH_NAME"])
from django_txqueue import Queue
from django_txqueue.models import QueueItem
"""

DRAIN = (
    SETUP
    + r"""
from django_txqueue.db import dialect_for
try:
    from django_txqueue.consumer.worker import Worker
except ImportError:  # a tree from before the consumer/ folder
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
)


ENQUEUE = (
    SETUP
    + r"""
items = int(sys.argv[1])
queue = Queue("bench-cpu")
QueueItem.objects.all().delete()
for n in range(200):
    queue.enqueue({"n": n})
wall, cpu = time.perf_counter(), time.process_time()
for n in range(items):
    queue.enqueue({"n": n})
print(items / (time.perf_counter() - wall), (time.process_time() - cpu) / items * 1e6)
QueueItem.objects.all().delete()
"""
)


def run(name: str, tree: str, code: str, *args: int) -> tuple[float, float]:
    """The rate and the CPU per item that ``code`` prints, run from ``tree`` on a database
    of its own (``txqueue_bench_cpu_`` and ``name``): the trees' migrations may differ."""
    env = dict(os.environ, PYTHONPATH=tree, TXQUEUE_BENCH_NAME=f"txqueue_bench_cpu_{name}")
    env.setdefault("TXQUEUE_TEST_DB", "postgresql")
    done = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
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
    if sys.argv[3:4] == ["enqueue"]:
        given = [int(arg) for arg in sys.argv[4:6]]
        items, rounds = given + [2_000, 6][len(given) :]
        code, args, what = ENQUEUE, [items], f"enqueue(), {items:,} calls"
    else:
        given = [int(arg) for arg in sys.argv[3:6]]
        batch, items, rounds = given + [10, 20_000, 6][len(given) :]
        code, args, what = DRAIN, [items, batch], f"batch {batch}, {items:,} items"
    found: dict[str, list[tuple[float, float]]] = {"before": [], "after": []}
    for round_ in range(rounds):
        order = [("before", before), ("after", after)]
        for name, tree in order if round_ % 2 == 0 else reversed(order):
            found[name].append(run(name, tree, code, *args))
    print(f"{what}, {rounds} rounds, load {os.getloadavg()[0]:.2f}")
    for name, runs in found.items():
        rate = statistics.median(r for r, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        every = ", ".join(f"{r:,.0f}" for r, _ in runs)
        print(f"  {name:6} {rate:8,.0f} items/s  {cpu:6.1f} µs CPU per item  ({every})")


if __name__ == "__main__":
    main()
