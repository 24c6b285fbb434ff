"""CPU per item, in this process, for enqueue and for a consumer's drain.

    PYTHONPATH=. DJANGO_SETTINGS_MODULE=tests.settings TXQUEUE_TEST_DB=postgresql \\
        python -m benchmarks.cpu

The rates of ``manage.py txqueue_bench`` include the server and the other processes; these
are the Python costs alone (``time.process_time``, best of 5 runs):

- ``enqueue()`` in ``transaction.atomic()`` beside the same single-row INSERT written by hand
  through Django's own cursor, in the same transaction handling;
- an in-process consumer draining 10,000 items at batch 10 and 100: CPU per item, and the
  statements its main thread sends per batch (counted with ``execute_wrapper``), with its
  handlers on the loop's own thread (as ``run_queue_consumer --concurrency 1`` runs them)
  and on a handler thread (a ``Worker`` made in a project's own code).

Uses its own database (``txqueue_bench_cpu``) or, on SQLite, a temp file.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

from .database import prepare_database

VENDOR = os.environ.get("TXQUEUE_TEST_DB", "sqlite")
ENQUEUES = 2000
DRAINED = 10_000


def best_cpu_per_item(run: Callable[[], None], items: int, rounds: int = 5) -> float:
    """Microseconds of this process's CPU per item, best of ``rounds``."""
    best = float("inf")
    for _ in range(rounds):
        started = time.process_time()
        run()
        best = min(best, (time.process_time() - started) / items * 1e6)
    return best


def enqueue_figures() -> tuple[float, float]:
    from django.db import connection, transaction

    from django_txqueue import enqueue
    from django_txqueue.models import QueueItem

    table = connection.ops.quote_name(QueueItem._meta.db_table)
    returning = "" if connection.vendor == "mysql" else " RETURNING id"
    sql = (
        f"INSERT INTO {table} (queue, payload, priority, max_attempts, last_error,"
        " error_class, status, pid, attempts)"
        f" VALUES (%s, %s, 0, 5, '', '', 1, '', 0){returning}"
    )

    def by_hand() -> None:
        for n in range(ENQUEUES):
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute(sql, ["bench-cpu", json.dumps({"n": n})])
                if returning:
                    cursor.fetchone()

    def ours() -> None:
        for n in range(ENQUEUES):
            with transaction.atomic():
                enqueue("bench-cpu", {"n": n})

    return best_cpu_per_item(by_hand, ENQUEUES), best_cpu_per_item(ours, ENQUEUES)


def drain_figures(batch: int, on_loop_thread: bool) -> tuple[float, float]:
    from django.db import connection

    from django_txqueue import Queue
    from django_txqueue.consumer.stopping import StopSignals
    from django_txqueue.consumer.worker import Worker
    from django_txqueue.models import QueueItem

    statements = []
    cpu = float("inf")
    for _ in range(3):
        QueueItem.objects.all().delete()
        for start in range(0, DRAINED, 5000):
            Queue("bench-cpu").enqueue_many([{"n": n} for n in range(start, start + 5000)])
        worker = Worker(
            handlers={"bench-cpu": lambda item: None},
            batch=batch,
            burst=True,
            signals=StopSignals() if on_loop_thread else None,
        )
        statements.clear()

        def count(execute, sql, params, many, context):  # type: ignore[no-untyped-def]
            statements.append(sql)
            return execute(sql, params, many, context)

        started = time.process_time()
        with connection.execute_wrapper(count):
            worker.run()
        cpu = min(cpu, (time.process_time() - started) / DRAINED * 1e6)
        if worker.processed != DRAINED:
            raise SystemExit(f"drained {worker.processed} of {DRAINED}")
    return cpu, len(statements) / (DRAINED / batch)


def main() -> None:
    prepare_database(VENDOR, "txqueue_bench_cpu")
    by_hand, ours = enqueue_figures()
    print(f"{VENDOR}: CPU per item (µs, best of runs; lower is better)")
    print(f"  enqueue() in atomic(): {ours:.0f}, the same INSERT by hand: {by_hand:.0f}")
    for batch in (10, 100):
        for on_loop_thread, where in ((True, "the loop's thread"), (False, "a handler thread")):
            cpu, per_batch = drain_figures(batch, on_loop_thread)
            print(
                f"  drain at batch {batch}, handlers on {where}: {cpu:.0f}, "
                f"{per_batch:.2f} statements per batch"
            )


if __name__ == "__main__":
    main()
