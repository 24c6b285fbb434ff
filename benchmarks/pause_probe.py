"""What the pause probe costs a claim that finds the queue running, on PostgreSQL.

    PYTHONPATH=. DJANGO_SETTINGS_MODULE=tests.settings TXQUEUE_TEST_DB=postgresql \\
        python -m benchmarks.pause_probe

Every claim statement reads its queue's pause flag itself (``claims.Claims.claimable``: an
uncorrelated NOT EXISTS on the pause table). This compares the planning and execution times
the server reports (``EXPLAIN (ANALYZE, SUMMARY)``) for the claim's candidate SELECT of a
queue of 10,000 READY items, with the probe and with the same statement less the probe,
interleaved, medians. Uses its own database (``txqueue_bench_pause``).
"""

from __future__ import annotations

import statistics

from .database import prepare_database

RUNS = 300
ITEMS = 10_000


def main() -> None:
    prepare_database("postgresql", "txqueue_bench_pause")
    from django.db import connection

    from django_txqueue import Queue
    from django_txqueue.db.compiler import ClaimStatement
    from django_txqueue.models import QueueItem

    queue = Queue("pause-probe")
    QueueItem.objects.filter(queue=queue.name).delete()
    queue.enqueue_many([{}] * ITEMS)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    statement = queue.claims.statement(10)
    with_probe, params = statement.candidates("FOR UPDATE SKIP LOCKED")
    # The same claim without the probe: the queue's items rather than its claimable ones.
    plain = ClaimStatement(queue.items, 10, queue=queue.name)
    without, plain_params = plain.candidates("FOR UPDATE SKIP LOCKED")

    times: dict[str, tuple[list[float], list[float]]] = {
        "with probe": ([], []),
        "without": ([], []),
    }
    with connection.cursor() as cursor:
        for _ in range(RUNS):
            for name, sql, args in (
                ("without", without, plain_params),
                ("with probe", with_probe, params),
            ):
                cursor.execute(f"EXPLAIN (ANALYZE, SUMMARY, FORMAT JSON) {sql}", args)
                plan = cursor.fetchone()[0]
                plan = plan[0] if isinstance(plan, list) else plan
                times[name][0].append(plan["Planning Time"] * 1000)
                times[name][1].append(plan["Execution Time"] * 1000)
    QueueItem.objects.filter(queue=queue.name).delete()
    print(f"claim of 10 from {ITEMS:,} READY items, {RUNS} runs each, medians (µs)")
    for name, (planning, execution) in times.items():
        p, e = statistics.median(planning), statistics.median(execution)
        print(f"{name:11s} planning {p:6.1f}  execution {e:6.1f}  together {p + e:6.1f}")


if __name__ == "__main__":
    main()
