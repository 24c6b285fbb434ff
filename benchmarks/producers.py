"""Producers side by side on PostgreSQL: what the NOTIFY at commit costs them.

    python -m benchmarks.producers [SECONDS] [COUNTS] [ROUNDS]   # e.g. 3 1,4,8,16 3

Each of N processes commits one item per transaction for SECONDS, in five ways, the ways
taking turns for each N: ``enqueue()`` inside ``transaction.atomic()`` (the trigger
NOTIFYs at commit), the same with the trigger disabled, and a raw psycopg INSERT into a
minimal table (``id``, ``payload``), each in its transaction as ``atomic()`` makes it,
without and with a ``pg_notify`` in it, and with the ``pg_notify`` sent after the commit
instead, in a transaction of its own. PostgreSQL serialises the commits of
transactions that notified behind one lock; the raw ways show what that costs without
any of our code. Items per second, all processes together: the median of ROUNDS
(default 1) rounds, the ways taking turns within each round.

Run by hand on its own database (``txqueue_bench_producers``), never by pytest; it
prints numbers and asserts nothing a noisy machine could fail.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import sys
import threading
import time
from typing import Any

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
os.environ["TXQUEUE_TEST_DB"] = "postgresql"  # NOTIFY is PostgreSQL's; the children inherit it
NAME = "txqueue_bench_producers"
QUEUE = "bench-producers"
MINIMAL = "txqueue_bench_producers_minimal"
WAYS = (
    "enqueue",
    "enqueue, no NOTIFY",
    "raw INSERT",
    "raw INSERT + NOTIFY",
    "raw INSERT, then NOTIFY",
)


def produce(way: str, seconds: float, ready: Any, counts: multiprocessing.Queue) -> None:
    """One producer: connects, waits for the others (``ready``), then commits for
    ``seconds``; puts how many it committed."""
    import django

    django.setup()
    from django.db import connection, transaction

    from django_txqueue import Queue

    queue = Queue(QUEUE)
    raw = None
    if way.startswith("raw"):
        import psycopg

        raw = psycopg.connect(host="127.0.0.1", user="postgres", dbname=NAME, autocommit=True)
    else:
        connection.ensure_connection()
    insert = f"INSERT INTO {MINIMAL} (payload) VALUES (%s)"  # noqa: S608 (a constant name)
    ready.wait()
    n = 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        if raw is None:
            with transaction.atomic():
                queue.enqueue({"n": n})
        else:
            with raw.transaction():
                raw.execute(insert, [f'{{"n": {n}}}'])
                if way == "raw INSERT + NOTIFY":
                    raw.execute("SELECT pg_notify('txqueue_bench_producers', %s)", [QUEUE])
            if way == "raw INSERT, then NOTIFY":  # in a transaction of its own, after
                raw.execute("SELECT pg_notify('txqueue_bench_producers', %s)", [QUEUE])
        n += 1
    counts.put(n)


def rate(way: str, producers: int, seconds: float) -> float:
    """Items per second of ``producers`` processes producing ``way``."""
    context = multiprocessing.get_context("spawn")
    counts = context.Queue()
    ready = context.Barrier(producers)  # every process connected before any starts
    processes = [
        context.Process(target=produce, args=(way, seconds, ready, counts))
        for _ in range(producers)
    ]
    for process in processes:
        process.start()
    total = sum(counts.get(timeout=seconds + 60) for _ in processes)
    for process in processes:
        process.join()
    return total / seconds


def listen(listening: threading.Event) -> None:
    """A consumer's LISTEN on both channels, read until ``listening`` is cleared: each
    notifying commit signals a listening backend, as it would with consumers running."""
    import psycopg

    with psycopg.connect(host="127.0.0.1", user="postgres", dbname=NAME, autocommit=True) as c:
        c.execute("LISTEN django_txqueue")
        c.execute("LISTEN txqueue_bench_producers")
        listening.set()
        while listening.is_set():
            for _ in c.notifies(timeout=0.2):
                pass


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 3.0
    numbers = [int(n) for n in (sys.argv[2] if len(sys.argv) > 2 else "1,4,8,16").split(",")]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    from benchmarks.database import prepare_database

    prepare_database("postgresql", NAME)
    from django.db import connection

    from django_txqueue.models import QueueItem

    table = connection.ops.quote_name(QueueItem._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(
            f"CREATE TABLE IF NOT EXISTS {MINIMAL} (id bigserial PRIMARY KEY, payload jsonb)"
        )
    print(
        f"postgresql, {os.cpu_count()} cores, {seconds:g} s a run, median of {rounds}, "
        f"load {os.getloadavg()[0]:.2f}"
    )
    print("producers | " + " | ".join(WAYS) + " | enqueue % of raw INSERT")
    listening = threading.Event()
    listener = threading.Thread(target=listen, args=(listening,), daemon=True)
    listener.start()
    listening.wait(timeout=10)
    try:
        for producers in numbers:
            runs: dict[str, list[float]] = {way: [] for way in WAYS}
            for _ in range(rounds):
                for way in WAYS:
                    with connection.cursor() as cursor:
                        cursor.execute(f"TRUNCATE {table}, {MINIMAL}")
                        toggle = "DISABLE" if way == "enqueue, no NOTIFY" else "ENABLE"
                        trigger = "TRIGGER django_txqueue_notify"
                        cursor.execute(f"ALTER TABLE {table} {toggle} {trigger}")
                    runs[way].append(rate(way, producers, seconds))
            found = {way: statistics.median(rates) for way, rates in runs.items()}
            cells = " | ".join(f"{found[way]:,.0f}/s" for way in WAYS)
            print(f"{producers} | {cells} | {found['enqueue'] / found['raw INSERT']:.0%}")
    finally:
        listening.clear()
        listener.join()
        with connection.cursor() as cursor:
            cursor.execute(f"ALTER TABLE {table} ENABLE TRIGGER django_txqueue_notify")
            cursor.execute(f"DROP TABLE IF EXISTS {MINIMAL}")


if __name__ == "__main__":
    main()
