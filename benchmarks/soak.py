"""The soak: steady enqueue and drain for a long while, consumers restarted every few minutes.

    PYTHONPATH=. DJANGO_SETTINGS_MODULE=tests.settings TXQUEUE_TEST_DB=postgresql \\
        python -m benchmarks.soak [--minutes 30] [--rate 200] [--consumers 2] \\
        [--restart-every 180] [--json PATH]

A producer thread enqueues ``--rate`` items a second on the ``soak`` queue, one per
transaction, each carrying its enqueue time; ``--consumers`` ``run_queue_consumer soak``
processes drain it (its handler, in tests/testapp/queues.py, records when it started),
and every ``--restart-every`` seconds the oldest gets SIGTERM (it must exit 0) and a
fresh one takes its place. Finished items are kept 60 s (``RETENTION``) and the
consumers purge them every 10 s, so the table should stay small.

Every 10 s it samples each consumer's RSS (/proc), the latency from enqueue to handler
start of the items finished in the last 10 s (p50, p99), the queue's unfinished and
total rows, and the table's size on disk. The verdict: memory flat (no consumer grows
by more than 5 MB after its first minute), latency flat (the last third's p99 within
twice the first third's, or under 50 ms), the table bounded (rows in the second half
no more than 1.5 times the first half's). Uses its own database (``txqueue_soak``) or,
on SQLite, a temp file. Run by hand, never by pytest.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

from .database import prepare_database
from .rss import rss_mb

VENDOR = os.environ.get("TXQUEUE_TEST_DB", "sqlite")
QUEUE = "soak"
SAMPLE_SECONDS = 10
WARM_UP_SECONDS = 60
CONSUMER_SETTINGS = {"PURGE_INTERVAL": 10, "QUEUES": {QUEUE: {"RETENTION": 60}}}


class Producer(threading.Thread):
    """Enqueues ``rate`` items a second, one per transaction, until stopped."""

    def __init__(self, rate: float) -> None:
        super().__init__(daemon=True)
        self.rate, self.stopping, self.enqueued = rate, threading.Event(), 0

    def run(self) -> None:
        from django.db import connection, transaction

        from django_txqueue import enqueue

        started = time.monotonic()
        while not self.stopping.is_set():
            due = started + self.enqueued / self.rate
            if (wait := due - time.monotonic()) > 0:
                time.sleep(wait)
            with transaction.atomic():
                enqueue(QUEUE, {"t": time.time()})
            self.enqueued += 1
        connection.close()


class Consumers:
    """The consumer processes, each with its start time and RSS samples."""

    def __init__(self, count: int, env: dict[str, str]) -> None:
        self.env = env
        self.running: list[dict[str, Any]] = []
        self.exits: list[int] = []
        self.growths: list[float] = []  # per stopped consumer: MB after its first minute
        for _ in range(count):
            self.start()

    def start(self) -> None:
        command = [sys.executable, "-m", "django", "run_queue_consumer", QUEUE, "-v", "0"]
        process = subprocess.Popen(command, env=self.env, stdout=subprocess.DEVNULL)
        self.running.append({"process": process, "started": time.monotonic(), "rss": []})

    def restart_oldest(self) -> None:
        oldest = self.running.pop(0)
        self.start()
        oldest["process"].send_signal(signal.SIGTERM)
        self.exits.append(oldest["process"].wait(60))
        self.finish(oldest)

    def finish(self, consumer: dict[str, Any]) -> None:
        """Keep a stopped consumer's memory figures: growth after its first minute."""
        warm = [mb for age, mb in consumer["rss"] if age >= WARM_UP_SECONDS]
        if len(warm) >= 2:
            self.growths.append(max(warm) - warm[0])

    def sample(self) -> list[float]:
        now = time.monotonic()
        sizes = []
        for consumer in self.running:
            if (mb := rss_mb(consumer["process"].pid)) is not None:
                consumer["rss"].append((now - consumer["started"], mb))
                sizes.append(mb)
        return sizes

    def stop(self) -> None:
        for consumer in self.running:
            consumer["process"].send_signal(signal.SIGTERM)
        for consumer in self.running:
            self.exits.append(consumer["process"].wait(60))
            self.finish(consumer)


def table_size_mb() -> float | None:
    from django.db import connection

    from django_txqueue.models import QueueItem

    table = QueueItem._meta.db_table
    with connection.cursor() as cursor:
        if VENDOR == "postgresql":
            cursor.execute("SELECT pg_total_relation_size(to_regclass(%s))", [table])
        elif VENDOR == "mysql":
            cursor.execute(
                "SELECT DATA_LENGTH + INDEX_LENGTH FROM information_schema.TABLES"
                " WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s",
                [table],
            )
        else:
            return None
        row = cursor.fetchone()
    return None if row is None or row[0] is None else int(row[0]) / 2**20


def latencies_ms(since: float) -> list[float]:
    """Enqueue to handler start of the items finished since ``since`` (wall clock)."""
    from django.utils import timezone

    from django_txqueue import Status
    from django_txqueue.models import QueueItem

    after = timezone.now() - dt.timedelta(seconds=time.time() - since)
    finished = QueueItem.objects.filter(queue=QUEUE, status=Status.DONE, finished_at__gte=after)
    return [
        (result["started"] - payload["t"]) * 1000
        for payload, result in finished.values_list("payload", "result")
        if result
    ]


def percentile(values: list[float], share: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--rate", type=float, default=200)
    parser.add_argument("--consumers", type=int, default=2)
    parser.add_argument("--restart-every", type=float, default=180)
    parser.add_argument("--json", metavar="PATH", help="Also write the samples as JSON here.")
    options = parser.parse_args()

    prepare_database(VENDOR, "txqueue_soak")
    from django.db import connection

    from django_txqueue import Status
    from django_txqueue.models import QueueItem

    QueueItem.objects.filter(queue=QUEUE).delete()
    env = {
        **os.environ,
        "TXQUEUE_TEST_NAME": str(connection.settings_dict["NAME"]),
        "TXQUEUE_TEST_SETTINGS": json.dumps(CONSUMER_SETTINGS),
    }
    consumers = Consumers(options.consumers, env)
    producer = Producer(options.rate)
    producer.start()
    began = time.monotonic()
    last_restart = began
    samples: list[dict[str, Any]] = []
    print(
        f"{VENDOR}: {options.minutes:g} min, {options.rate:g} items/s, "
        f"{options.consumers} consumers restarted every {options.restart_every:g} s"
    )
    print(f"{'t (s)':>6} {'enqueued':>9} {'unfinished':>10} {'rows':>7} {'table MB':>8} "
          f"{'p50 ms':>7} {'p99 ms':>7}  consumer RSS MB")  # fmt: skip
    try:
        while time.monotonic() - began < options.minutes * 60:
            sampled_at = time.time()
            time.sleep(SAMPLE_SECONDS)
            if time.monotonic() - last_restart >= options.restart_every:
                consumers.restart_oldest()
                last_restart = time.monotonic()
            waits = latencies_ms(sampled_at)
            items = QueueItem.objects.filter(queue=QUEUE)
            sample = {
                "t": round(time.monotonic() - began),
                "enqueued": producer.enqueued,
                "unfinished": items.filter(status__in=[Status.READY, Status.IN_PROGRESS]).count(),
                "rows": items.count(),
                "table_mb": table_size_mb(),
                "p50_ms": percentile(waits, 0.5),
                "p99_ms": percentile(waits, 0.99),
                "rss_mb": consumers.sample(),
            }
            samples.append(sample)
            print(
                f"{sample['t']:>6} {sample['enqueued']:>9,} {sample['unfinished']:>10,} "
                f"{sample['rows']:>7,} {fmt(sample['table_mb']):>8} {fmt(sample['p50_ms']):>7} "
                f"{fmt(sample['p99_ms']):>7}  {' '.join(f'{mb:.1f}' for mb in sample['rss_mb'])}",
                flush=True,
            )
    finally:
        producer.stopping.set()
        producer.join(10)
        consumers.stop()
    verdict = judge(samples, consumers)
    print(json.dumps(verdict, indent=2))
    if options.json:
        with open(options.json, "w") as out:
            json.dump({"samples": samples, "verdict": verdict}, out, indent=2)


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def judge(samples: list[dict[str, Any]], consumers: Consumers) -> dict[str, Any]:
    third = max(1, len(samples) // 3)
    first = [s["p99_ms"] for s in samples[:third] if s["p99_ms"] is not None]
    last = [s["p99_ms"] for s in samples[-third:] if s["p99_ms"] is not None]
    half = len(samples) // 2
    rows_first = max((s["rows"] for s in samples[:half]), default=0)
    rows_second = max((s["rows"] for s in samples[half:]), default=0)
    growth = max(consumers.growths, default=0.0)
    p99_first = statistics.median(first) if first else None
    p99_last = statistics.median(last) if last else None
    latency_flat = p99_last is not None and (
        p99_last < 50 or (p99_first is not None and p99_last <= 2 * p99_first)
    )
    return {
        "consumer_lifetimes_measured": len(consumers.growths),
        "max_rss_growth_after_warm_up_mb": round(growth, 1),
        "memory_flat": growth <= 5,
        "p99_ms_first_third_median": p99_first,
        "p99_ms_last_third_median": p99_last,
        "latency_flat": latency_flat,
        "max_rows_first_half": rows_first,
        "max_rows_second_half": rows_second,
        "table_bounded": rows_second <= 1.5 * max(rows_first, 1),
        "consumer_exit_codes": sorted(set(consumers.exits)),
        "every_sigterm_exit_0": all(code == 0 for code in consumers.exits),
    }


if __name__ == "__main__":
    main()
