"""Where one ``enqueue()``'s time goes on PostgreSQL, layer by layer, one producer.

    python -m benchmarks.enqueue_cost [ROUNDS]   # e.g. 30

Each way commits 100 items, one per transaction, and the ways take turns for ROUNDS
rounds (default 30); the medians of the rounds, wall time and this process's CPU per
item. From a raw psycopg transaction with one INSERT into a minimal table, each way adds
one layer: Django's ``transaction.atomic()`` and cursor, the queue's own table (its row,
its indexes) without and with its NOTIFY trigger, then ``enqueue()`` itself (the checks,
the item, the row). The queue's two tables are copies made for the run (``LIKE ...
INCLUDING ALL``), the trigger on one of them; the copies are dropped after it.

Run by hand on its own database (``txqueue_bench_enqueue``), never by pytest; it prints
numbers and asserts nothing a noisy machine could fail.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
os.environ["TXQUEUE_TEST_DB"] = "postgresql"
NAME = "txqueue_bench_enqueue"
QUEUE = "bench-enqueue"
PER_ROUND = 100
MINIMAL, BARE, NOTIFYING = "txqueue_bench_minimal", "txqueue_bench_bare", "txqueue_bench_told"


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    from benchmarks.database import prepare_database

    prepare_database("postgresql", NAME)
    import psycopg
    from django.db import connection, transaction

    from django_txqueue import Queue
    from django_txqueue.db import dialect
    from django_txqueue.db.inserts import inserts
    from django_txqueue.models import QueueItem

    queue = Queue(QUEUE)
    rows = inserts(QueueItem, queue.using)
    connection.ensure_connection()
    # The INSERT enqueue() sends for this queue, its text and values.
    shape, params = rows.row(connection, queue.build({"n": 0}), literals=True)
    sql, _ = rows.statement(connection, shape, 1)
    table = connection.ops.quote_name(QueueItem._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(f"CREATE TABLE {MINIMAL} (id bigserial PRIMARY KEY, payload jsonb)")
        for copy in (BARE, NOTIFYING):
            cursor.execute(f"CREATE TABLE {copy} (LIKE {table} INCLUDING ALL)")
        cursor.execute(
            f"CREATE TRIGGER told AFTER INSERT ON {NOTIFYING} REFERENCING NEW TABLE AS "
            "inserted FOR EACH STATEMENT EXECUTE FUNCTION django_txqueue_notify()"
        )
    raw = psycopg.connect(host="127.0.0.1", user="postgres", dbname=NAME, autocommit=True)
    hot = dialect(connection).hot_cursor
    minimal = f"INSERT INTO {MINIMAL} (payload) VALUES (%s) RETURNING id"  # noqa: S608

    def raw_insert() -> None:
        with raw.transaction():
            raw.execute(minimal, ['{"n": 0}']).fetchall()

    def inserted(statement: str, values: list[object]) -> Callable[[], None]:
        def insert() -> None:
            with transaction.atomic(), hot(connection) as cursor:
                cursor.execute(statement, values)
                cursor.fetchall()

        return insert

    def enqueue() -> None:
        with transaction.atomic():
            queue.enqueue({"n": 0})

    ways = {
        "raw psycopg transaction, minimal table": raw_insert,
        "+ Django's atomic() and cursor": inserted(minimal, ['{"n": 0}']),
        "+ the queue's table, no trigger": inserted(sql.replace(table, BARE), params),
        "+ its NOTIFY trigger": inserted(sql.replace(table, NOTIFYING), params),
        "+ enqueue() itself": enqueue,
    }
    wall: dict[str, list[float]] = {way: [] for way in ways}
    cpu: dict[str, list[float]] = {way: [] for way in ways}
    try:
        for _ in range(rounds):
            for way, commit in ways.items():
                started, used = time.perf_counter(), time.thread_time()
                for _ in range(PER_ROUND):
                    commit()
                cpu[way].append((time.thread_time() - used) / PER_ROUND * 1e6)
                wall[way].append((time.perf_counter() - started) / PER_ROUND * 1e6)
    finally:
        raw.close()
        with connection.cursor() as cursor:
            cursor.execute(f"DROP TABLE IF EXISTS {MINIMAL}, {BARE}, {NOTIFYING}")
            cursor.execute(f"TRUNCATE {table}")
    base = statistics.median(wall["raw psycopg transaction, minimal table"])
    print(f"postgresql, {os.cpu_count()} cores, medians of {rounds} rounds of {PER_ROUND}")
    print("| one producer | wall per item | CPU per item (client) | items/s | % of the first |")
    print("|---|---|---|---|---|")
    for way in ways:
        took = statistics.median(wall[way])
        print(
            f"| {way} | {took:,.0f} µs | {statistics.median(cpu[way]):,.0f} µs "
            f"| {1e6 / took:,.0f} | {base / took:.0%} |"
        )


if __name__ == "__main__":
    main()
