"""The cost of Prometheus metrics (docs/metrics.md): one consumer's drain with metrics
off and on, in interleaved pairs, in this process.

    PYTHONPATH=. DJANGO_SETTINGS_MODULE=tests.settings TXQUEUE_TEST_DB=postgresql \\
        python -m benchmarks.metrics [PAIRS] [ITEMS] [BATCH] [SCRAPE_EVERY]

Each pair drains ITEMS no-op items (default 10,000, batch 10) twice with a burst
``Worker``, metrics off and on, the order alternating from pair to pair, so that the
shared machine's drift falls on both alike. "On" is what ``--metrics-port`` turns on in
a consumer (``metrics.enable``: counters and histograms recorded per claimed and per
settled batch), with a scrape of the registry every SCRAPE_EVERY seconds (default 1, a
tight Prometheus; 0: none, the recording's cost alone).

Prints, for each, the median and spread (min to max) of the drain rate and of this
process's CPU per item, the medians' difference, and each pair's difference with their
median's 95% interval (bootstrap): a machine whose speed drifts from minute to minute
moves single pairs by 10% or more, and the interval says how far the median can be
trusted. As the shared machine's noise can
hide a few percent, it then drains three more times with the recorder's two calls timed
by the main thread's CPU clock, and prints its CPU per item as a share of the CPU per
item with metrics off.

    python -m benchmarks.metrics sliced [DRAINS] [ITEMS] [BATCH] [SECONDS]

Finer: DRAINS drains of ITEMS (default 3 of 150,000, batch 10), each with the recorder
switched on and off every SECONDS (default 0.5) while it runs; each "on" slice's rate is
compared with the "off" slices either side of it (``sliced``).

Uses its own database (``txqueue_bench_metrics``) or, on SQLite, a temp file.
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import threading
import time

from .database import prepare_database

VENDOR = os.environ.get("TXQUEUE_TEST_DB", "sqlite")
QUEUE = "bench-metrics"


# Seconds spent in the recorder's calls during the current drain.
spent = [0.0]


def timed_recorder(registry: object) -> object:
    """A ``Recorder`` whose two per-batch calls add their time to ``spent``."""
    from django_txqueue.observe import metrics

    class Timed(metrics.Recorder):
        def claimed(self, items: list) -> None:  # type: ignore[type-arg]
            started = time.thread_time()
            super().claimed(items)
            spent[0] += time.thread_time() - started

        def settled(self, outcomes: object) -> None:
            started = time.thread_time()
            super().settled(outcomes)  # type: ignore[arg-type]
            spent[0] += time.thread_time() - started

    return Timed(registry)


def fill(items: int) -> None:
    """``items`` no-op items in the queue, and nothing else."""
    from django_txqueue import Queue
    from django_txqueue.db import dialect_for
    from django_txqueue.models import QueueItem

    QueueItem.objects.filter(queue=QUEUE).delete()
    for start in range(0, items, 5000):
        Queue(QUEUE).enqueue_many([{"n": n} for n in range(start, min(start + 5000, items))])
    # The deleted rows gone, as autovacuum would leave them (off on some servers: then
    # every drain's rows stay dead, and each scrape reads them all).
    dialect_for("default").analyze(QueueItem.objects.all())


def sliced(items: int, batch: int, seconds: float) -> list[tuple[float, float]]:
    """One drain of ``items`` with the recorder switched on and off every ``seconds``:
    for each "on" slice, its rate and its CPU per item against the mean of the "off"
    slices either side, in percent. Slices a second or less apart meet the same state
    of the machine, where drains some seconds apart may not; the mean of both
    neighbours cancels a drift."""
    from prometheus_client import CollectorRegistry

    from django_txqueue.consumer.worker import Worker
    from django_txqueue.observe import metrics

    fill(items)
    recorder = metrics.Recorder(CollectorRegistry(auto_describe=False))
    worker = Worker(handlers={QUEUE: lambda item: None}, batch=batch, burst=True)
    slices: list[tuple[float, float]] = []  # rate, CPU per item; off and on in turn
    done = threading.Event()

    def switch() -> None:
        done.wait(seconds)  # the first slice, as the drain starts: not counted
        on, counted = False, worker.processed
        started, cpu = time.perf_counter(), time.process_time()
        while not done.wait(seconds):
            now, now_cpu, processed = time.perf_counter(), time.process_time(), worker.processed
            taken = max(processed - counted, 1)
            slices.append((taken / (now - started), (now_cpu - cpu) / taken))
            on = not on
            metrics.recorder = recorder if on else None
            counted, started, cpu = processed, now, now_cpu

    switcher = threading.Thread(target=switch, daemon=True)
    metrics.recorder = None
    switcher.start()
    worker.run()
    done.set()
    switcher.join()
    metrics.recorder = None
    slices = slices[:-1]  # the last slice may have run out of items

    def against_neighbours(i: int, part: int) -> float:
        return 100 * (slices[i][part] / ((slices[i - 1][part] + slices[i + 1][part]) / 2) - 1)

    return [
        (against_neighbours(i, 0), against_neighbours(i, 1)) for i in range(1, len(slices) - 1, 2)
    ]


def drain(
    items: int, batch: int, registry: object | None, every: float = 1.0, timed: bool = False
) -> tuple[float, float]:
    """Fill and drain ``items``; items per second and CPU µs per item of this process."""
    from prometheus_client import generate_latest

    from django_txqueue.consumer.worker import Worker
    from django_txqueue.observe import metrics

    fill(items)
    if registry is None:
        metrics.recorder = None
    elif timed:
        metrics.recorder = timed_recorder(registry)  # type: ignore[assignment]
    else:
        metrics.recorder = metrics.Recorder(registry)
    spent[0] = 0.0
    stop = threading.Event()

    def scrape_every_second() -> None:
        while not stop.wait(every):
            generate_latest(registry)  # type: ignore[arg-type]

    scraper = threading.Thread(target=scrape_every_second, daemon=True)
    if registry is not None and every > 0:
        scraper.start()
    worker = Worker(handlers={QUEUE: lambda item: None}, batch=batch, burst=True)
    cpu, wall = time.process_time(), time.perf_counter()
    worker.run()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    stop.set()
    metrics.recorder = None
    if worker.processed != items:
        raise SystemExit(f"drained {worker.processed} of {items}")
    return items / wall, cpu / items * 1e6


def median_interval(values: list[float], draws: int = 5000) -> tuple[float, float]:
    """The 95% interval of ``values``' median, by resampling them (bootstrap; a fixed
    seed, so that the same values print the same interval)."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return medians[int(draws * 0.025)], medians[int(draws * 0.975) - 1]


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})"


def main_sliced() -> None:
    given = [float(arg) for arg in sys.argv[2:6]]
    drains, items, batch, seconds = given + [3, 150_000, 10, 0.5][len(given) :]
    prepare_database(VENDOR, "txqueue_bench_metrics")
    sliced(min(int(items), 5000), int(batch), seconds)  # warm-up
    found: list[tuple[float, float]] = []
    for _ in range(int(drains)):
        found += sliced(int(items), int(batch), seconds)
        print(f"{len(found)} slices on so far", file=sys.stderr)
    print(
        f"{VENDOR}: {int(drains)} drains of {int(items):,} items, batch {int(batch)}, "
        f"metrics on and off in turn every {seconds:g} s, no scrape"
    )
    print(f"  {len(found)} slices on, against the slices off either side:")
    for part, what in enumerate(("rate", "CPU per item")):
        values = [each[part] for each in found]
        low, high = median_interval(values)
        print(
            f"    {what}: median {statistics.median(values):+.1f}% "
            f"(95% interval {low:+.1f}% to {high:+.1f}%), mean {statistics.mean(values):+.1f}%"
        )
    print(f"  each slice's rate: {', '.join(f'{rate:+.1f}%' for rate, _ in found)}")


def main() -> None:
    if sys.argv[1:2] == ["sliced"]:
        return main_sliced()
    given = [float(arg) for arg in sys.argv[1:5]]
    pairs, items, batch, every = given + [7, 10_000, 10, 1.0][len(given) :]
    pairs, items, batch = int(pairs), int(items), int(batch)
    prepare_database(VENDOR, "txqueue_bench_metrics")
    from prometheus_client import CollectorRegistry

    from django_txqueue.observe.collector import QueueCollector

    runs: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}
    drain(min(items, 2000), batch, None)  # warm-up: imports, compiled statements
    for pair in range(pairs):
        for mode in ("off", "on") if pair % 2 == 0 else ("on", "off"):
            registry = None
            if mode == "on":
                registry = CollectorRegistry(auto_describe=False)
                registry.register(QueueCollector())
            runs[mode].append(drain(items, batch, registry, every))
            print(f"pair {pair + 1} {mode}: {runs[mode][-1][0]:,.0f} items/s", file=sys.stderr)
    scrapes = f"a scrape every {every:g} s" if every > 0 else "no scrape"
    # The recorder's own CPU, apart: its clock read four times a batch would slow the
    # pairs' "on" drains by more than it measures (each read a system call, where a
    # loaded machine may switch to another process).
    recording = []  # µs per item in the recorder
    for _ in range(3):
        drain(items, batch, CollectorRegistry(auto_describe=False), 0, timed=True)
        recording.append(spent[0] / items * 1e6)
    print(f"{VENDOR}: {pairs} interleaved pairs, {items:,} items each, batch {batch}, {scrapes}")
    print("             items/s, median (min-max)   CPU µs/item, median (min-max)")
    for mode, found in runs.items():
        rates, cpus = [r for r, _ in found], [c for _, c in found]
        print(f"  metrics {mode:3}  {spread(rates):28} {spread(cpus)}")
    off_rate, on_rate = (statistics.median(r for r, _ in runs[m]) for m in ("off", "on"))
    off_cpu, on_cpu = (statistics.median(c for _, c in runs[m]) for m in ("off", "on"))
    print(
        f"  on vs off: rate {100 * (on_rate / off_rate - 1):+.1f}%, "
        f"CPU per item {100 * (on_cpu / off_cpu - 1):+.1f}%"
    )
    pairs_found = zip(runs["off"], runs["on"], strict=True)
    print(
        f"  in the recorder (3 more drains, timed): {statistics.median(recording):.1f} µs/item "
        f"({min(recording):.1f}-{max(recording):.1f}), "
        f"{100 * statistics.median(recording) / off_cpu:.1f}% of the CPU per item with metrics off"
    )
    per_pair = [100 * (on[0] / off[0] - 1) for off, on in pairs_found]
    low, high = median_interval(per_pair)
    print(
        f"  per pair, rate on vs off: {', '.join(f'{p:+.1f}%' for p in per_pair)}"
        f" (median {statistics.median(per_pair):+.1f}%, 95% interval {low:+.1f}% to {high:+.1f}%)"
    )


if __name__ == "__main__":
    main()
