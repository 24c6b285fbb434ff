"""Drain throughput: a consumer with default settings vs hand-written SQL, same table, same run.

    PYTHONPATH=. DJANGO_SETTINGS_MODULE=tests.settings TXQUEUE_TEST_DB=postgresql \\
        python -m tests.bench.drain [--processes N] [--strategy S] [ITEMS] [BATCH ...]

DESIGN section 11: draining no-op items must reach 85% of the hand-written queue's rate at
the same batch size. The baseline claims with one statement of the same strategy
(``skip_locked``: SELECT ... FOR UPDATE SKIP LOCKED; ``update_limit``: UPDATE ... ORDER BY
... LIMIT, read back by token, on MySQL/MariaDB) and acknowledges the batch with one
UPDATE, on the connection in autocommit: the ceiling. ``--processes`` runs that many
consumers (or loops) at once; the rate is all items over first start to last finish.
Uses its own database (``TXQUEUE_BENCH_DB``, default ``txqueue_bench``) or, on SQLite, a
temp file.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import secrets
import time

from . import prepare_database

VENDOR = os.environ.get("TXQUEUE_TEST_DB", "sqlite")
DATABASE = os.environ.get("TXQUEUE_BENCH_DB", "txqueue_bench")


def fill(count: int) -> None:
    from django_txqueue import Queue
    from django_txqueue.models import QueueItem

    QueueItem.objects.all().delete()
    queue = Queue("bench-drain")
    for start in range(0, count, 5000):
        queue.enqueue_many([{"n": n} for n in range(start, min(start + 5000, count))])
    from django.db import connection

    with connection.cursor() as cursor:
        if VENDOR == "postgresql":
            cursor.execute("VACUUM ANALYZE django_txqueue_queueitem")
        elif VENDOR == "mysql":
            cursor.execute("ANALYZE TABLE django_txqueue_queueitem")
            cursor.fetchall()


def drain_with_worker(batch: int, strategy: str) -> int:
    from django_txqueue.worker import Worker

    worker = Worker(
        handlers={"bench-drain": lambda item: None}, batch=batch, strategy=strategy, burst=True
    )
    worker.run()
    return worker.processed


def drain_by_hand(batch: int, strategy: str) -> int:
    """The ceiling: one claim statement and one acknowledgement per batch, no ORM."""
    from django.db import connection

    connection.ensure_connection()
    table = "django_txqueue_queueitem"
    lock = "FOR UPDATE SKIP LOCKED" if strategy == "skip_locked" else "FOR UPDATE"
    done = 0
    with connection.cursor() as cursor:
        while True:
            if VENDOR == "mysql" and strategy == "update_limit":
                # As a DBA would write it after EXPLAIN: without the hint MariaDB plans
                # it on (status, claim_token) with a filesort, locking every READY row.
                token = secrets.randbits(63)
                cursor.execute(
                    f"UPDATE {table} FORCE INDEX (txqueue_item_ready) SET status = 2,"
                    " pid = 'x', claim_token = %s, attempts = attempts + 1,"
                    " claimed_at = NOW(6), lease_expires_at = NOW(6) + INTERVAL 300 SECOND"
                    " WHERE status = 1 AND queue = %s AND run_at <= NOW(6)"
                    " ORDER BY priority, run_at, id LIMIT %s",
                    [token, "bench-drain", batch],
                )
                ids = []
                if cursor.rowcount:
                    cursor.execute(
                        f"SELECT id, payload FROM {table} WHERE status = 2 AND claim_token = %s",
                        [token],
                    )
                    ids = [row[0] for row in cursor.fetchall()]
            elif VENDOR == "postgresql":
                cursor.execute(
                    f"WITH c AS MATERIALIZED (SELECT id FROM {table}"
                    " WHERE queue = %s AND status = 1 AND run_at <= now()"
                    f" ORDER BY priority, run_at, id LIMIT %s {lock})"
                    f" UPDATE {table} t SET status = 2, pid = 'x', attempts = t.attempts + 1,"
                    " claimed_at = now(), lease_expires_at = now() + interval '300 s'"
                    " FROM c WHERE t.id = c.id RETURNING t.id, t.payload",
                    ["bench-drain", batch],
                )
                ids = [row[0] for row in cursor.fetchall()]
                if not ids and strategy == "update_limit":
                    # FOR UPDATE waited for a row another loop took: look again if any left.
                    cursor.execute(
                        f"SELECT 1 FROM {table} WHERE queue = %s AND status = 1 LIMIT 1",
                        ["bench-drain"],
                    )
                    if cursor.fetchone():
                        continue
            elif VENDOR == "mysql":
                cursor.execute("START TRANSACTION")
                cursor.execute(
                    f"SELECT id, payload FROM {table} WHERE status = 1 AND queue = %s"
                    f" AND run_at <= NOW(6) ORDER BY priority, run_at, id LIMIT %s {lock}",
                    ["bench-drain", batch],
                )
                ids = [row[0] for row in cursor.fetchall()]
                if ids:
                    marks = ", ".join(["%s"] * len(ids))
                    cursor.execute(
                        f"UPDATE {table} SET status = 2, pid = 'x', attempts = attempts + 1,"
                        " claimed_at = NOW(6), lease_expires_at = NOW(6) + INTERVAL 300 SECOND"
                        f" WHERE id IN ({marks})",
                        ids,
                    )
                cursor.execute("COMMIT")
            else:
                cursor.execute(
                    f"UPDATE {table} SET status = 2, pid = 'x', attempts = attempts + 1,"
                    " claimed_at = STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'NOW')"
                    f" WHERE id IN (SELECT id FROM {table} WHERE queue = %s AND status = 1"
                    " AND run_at <= STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'NOW')"
                    " ORDER BY priority, run_at, id LIMIT %s) RETURNING id, payload",
                    ["bench-drain", batch],
                )
                ids = [row[0] for row in cursor.fetchall()]
            if not ids:
                break
            marks = ", ".join(["%s"] * len(ids))
            cursor.execute(
                f"UPDATE {table} SET status = 3, finished_at = CURRENT_TIMESTAMP"
                f" WHERE id IN ({marks}) AND status = 2",
                ids,
            )
            done += len(ids)
    return done


def consume(drain, batch: int, strategy: str, start, results) -> None:
    """One consumer process: wait for the start, drain, report (items, started, ended)."""
    start.wait()
    started = time.time()
    results.put((drain(batch, strategy), started, time.time()))


def rate(drain, batch: int, strategy: str, processes: int) -> float:
    """Items per second of ``processes`` consumers running ``drain`` at once."""
    from django.db import connections

    connections.close_all()  # each forked consumer opens its own
    context = multiprocessing.get_context("fork")
    start, results = context.Event(), context.Queue()
    children = [
        context.Process(target=consume, args=(drain, batch, strategy, start, results))
        for _ in range(processes)
    ]
    for child in children:
        child.start()
    start.set()
    reports = [results.get() for _ in children]
    for child in children:
        child.join()
    items = sum(report[0] for report in reports)
    return items / (max(r[2] for r in reports) - min(r[1] for r in reports))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("items", nargs="?", type=int, default=5000)
    parser.add_argument("batches", nargs="*", type=int, default=[1, 10, 100])
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--strategy", choices=["skip_locked", "update_limit"], default=None)
    options = parser.parse_args()
    prepare_database(VENDOR, DATABASE)
    from django.db import connection

    from django_txqueue.db import dialect

    strategy = options.strategy or dialect(connection).resolve_strategy("auto", connection)
    print(
        f"{VENDOR}, {strategy}, {options.processes} consumer(s): draining {options.items}"
        " no-op items (items/s; higher is better)"
    )
    print(f"{'batch':>6} {'hand-written SQL':>17} {'run_queue_consumer':>19} {'ratio':>7}")
    for batch in options.batches:
        fill(options.items)
        ceiling = rate(drain_by_hand, batch, strategy, options.processes)
        fill(options.items)
        ours = rate(drain_with_worker, batch, strategy, options.processes)
        print(f"{batch:>6} {ceiling:>17,.0f} {ours:>19,.0f} {ours / ceiling:>7.0%}", flush=True)


if __name__ == "__main__":
    main()
