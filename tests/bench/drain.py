"""Drain throughput: a consumer with default settings vs hand-written SQL, same table, same run.

    PYTHONPATH=. DJANGO_SETTINGS_MODULE=tests.settings TXQUEUE_TEST_DB=postgresql \\
        python -m tests.bench.drain [ITEMS] [BATCH ...]

DESIGN section 11: draining no-op items must reach 85% of the hand-written queue's rate at
the same batch size. The baseline claims with one SKIP LOCKED statement and acknowledges
the batch with one UPDATE, on a raw driver connection in autocommit: the ceiling.
Uses its own database (``txqueue_bench``, or ``TXQUEUE_BENCH_DB`` so that runs sharing a
server do not collide) or, on SQLite, a temp file.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

VENDOR = os.environ.get("TXQUEUE_TEST_DB", "sqlite")
DATABASE = os.environ.get("TXQUEUE_BENCH_DB", "txqueue_bench")


def prepare_database() -> None:
    if VENDOR == "sqlite":
        os.environ["TXQUEUE_TEST_NAME"] = os.path.join(tempfile.mkdtemp(), "bench.sqlite3")
    else:
        os.environ["TXQUEUE_TEST_NAME"] = DATABASE
        if VENDOR == "postgresql":
            import psycopg

            with psycopg.connect(
                host="127.0.0.1", user="postgres", dbname="postgres", autocommit=True
            ) as conn:
                if not conn.execute(
                    "SELECT 1 FROM pg_database WHERE datname = %s", [DATABASE]
                ).fetchone():
                    conn.execute(f'CREATE DATABASE "{DATABASE}"')
        else:
            import MySQLdb

            conn = MySQLdb.connect(host="127.0.0.1", user="root")
            conn.cursor().execute(f"CREATE DATABASE IF NOT EXISTS `{DATABASE}`")
            conn.close()
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)


def fill(count: int) -> None:
    from django_txqueue import Queue
    from django_txqueue.models import QueueItem

    QueueItem.objects.all().delete()
    queue = Queue("bench-drain")
    for start in range(0, count, 5000):
        queue.enqueue_many([{"n": n} for n in range(start, min(start + 5000, count))])
    if VENDOR == "postgresql":
        from django.db import connection

        with connection.cursor() as cursor:
            cursor.execute("VACUUM ANALYZE django_txqueue_queueitem")


def drain_with_worker(batch: int) -> float:
    from django_txqueue.worker import Worker

    worker = Worker(handlers={"bench-drain": lambda item: None}, batch=batch, burst=True)
    started = time.perf_counter()
    worker.run()
    return worker.processed / (time.perf_counter() - started)


def drain_by_hand(batch: int) -> float:
    """The ceiling: one claim statement and one acknowledgement per batch, no ORM."""
    from django.db import connection

    connection.ensure_connection()
    table = "django_txqueue_queueitem"
    done = 0
    started = time.perf_counter()
    with connection.cursor() as cursor:
        while True:
            if VENDOR == "postgresql":
                cursor.execute(
                    f"WITH c AS MATERIALIZED (SELECT id FROM {table}"
                    " WHERE queue = %s AND status = 1 AND run_at <= now()"
                    " ORDER BY priority, run_at, id LIMIT %s"
                    " FOR UPDATE SKIP LOCKED)"
                    f" UPDATE {table} t SET status = 2, pid = 'x', attempts = t.attempts + 1,"
                    " claimed_at = now(), lease_expires_at = now() + interval '300 s'"
                    " FROM c WHERE t.id = c.id RETURNING t.id, t.payload",
                    ["bench-drain", batch],
                )
                ids = [row[0] for row in cursor.fetchall()]
            elif VENDOR == "mysql":
                cursor.execute("START TRANSACTION")
                cursor.execute(
                    f"SELECT id, payload FROM {table} WHERE status = 1 AND queue = %s"
                    " AND run_at <= NOW(6) ORDER BY priority, run_at, id LIMIT %s"
                    " FOR UPDATE SKIP LOCKED",
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
    return done / (time.perf_counter() - started)


def main() -> None:
    items = int(sys.argv[1]) if len(sys.argv) > 1 else 5000
    batches = [int(b) for b in sys.argv[2:]] or [1, 10, 100]
    prepare_database()
    print(f"{VENDOR}: draining {items} no-op items (items/s; higher is better)")
    print(f"{'batch':>6} {'hand-written SQL':>17} {'run_queue_consumer':>19} {'ratio':>7}")
    for batch in batches:
        fill(items)
        ceiling = drain_by_hand(batch)
        fill(items)
        ours = drain_with_worker(batch)
        print(f"{batch:>6} {ceiling:>17,.0f} {ours:>19,.0f} {ours / ceiling:>7.0%}")


if __name__ == "__main__":
    main()
