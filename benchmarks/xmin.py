"""Claims while another transaction holds back PostgreSQL's xmin horizon.

    PYTHONPATH=. DJANGO_SETTINGS_MODULE=tests.settings TXQUEUE_TEST_DB=postgresql \\
        python -m benchmarks.xmin [MINUTES]

Every SKIP LOCKED queue leaves dead row versions behind (each item is inserted, claimed and
acknowledged: three versions). While any transaction keeps an old snapshot open, VACUUM
cannot remove them and the claim's index scan must step over them. This bench churns one
queue (enqueue 100, claim them 10 at a time, acknowledge each batch) and prints the claim
rate per 30 s: first for MINUTES/5 minutes as a baseline, then for MINUTES (default 10)
while another connection holds a REPEATABLE READ snapshot open. The last window is
compared with the baseline. Uses its own database (``txqueue_bench_xmin``).

Claims go the consumer's way (``claims.Resume``: each starts after the last item
claimed, with a claim from the head at least every second); ``--from-head`` makes every
claim read the READY index from its head, as ``Queue.claim`` does.
"""

from __future__ import annotations

import sys
import threading
import time

from .database import prepare_database

WINDOW = 30.0


def churn(seconds: float, from_head: bool) -> list[float]:
    """Claim rates (claims per second of claiming) per WINDOW over ``seconds``."""
    from django_txqueue import Queue, store
    from django_txqueue.consumer.claims import Resume
    from django_txqueue.models import QueueItem
    from django_txqueue.store import Ack

    queue = Queue("bench-xmin")
    resume = Resume(queue.claims)

    def claim() -> list[QueueItem]:
        if from_head:
            return queue.claim(10)
        return resume.ack_and_claim(None, 10, pid="bench-xmin")[1]

    rates, claimed, claiming = [], 0, 0.0
    window_end = time.monotonic() + WINDOW
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        queue.enqueue_many([{"n": n} for n in range(100)])
        for _ in range(10):
            started = time.perf_counter()
            items = claim()
            claiming += time.perf_counter() - started
            claimed += len(items)
            if items:
                results = {item.pk: None for item in items}
                store.ack_many(QueueItem, "default", Ack(items[0].claim_token, results))
        if time.monotonic() >= window_end:
            rates.append(claimed / claiming)
            print(f"  {len(rates) * WINDOW:>5.0f} s: {rates[-1]:>7,.0f} claims/s", flush=True)
            claimed, claiming = 0, 0.0
            window_end += WINDOW
    return rates


def hold_snapshot(stop: threading.Event) -> None:
    """Keep a REPEATABLE READ snapshot open until ``stop``: the xmin horizon stays put."""
    import psycopg
    from django.db import connection

    params = connection.get_connection_params()
    with psycopg.connect(**params) as holder:
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM django_txqueue_queueitem").fetchone()
        stop.wait()
        holder.rollback()


def main() -> None:
    from_head = "--from-head" in sys.argv
    numbers = [arg for arg in sys.argv[1:] if not arg.startswith("--")]
    minutes = float(numbers[0]) if numbers else 10.0
    prepare_database("postgresql", "txqueue_bench_xmin")
    from django.db import connection

    from django_txqueue.models import QueueItem

    QueueItem.objects.all().delete()
    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE django_txqueue_queueitem")
    print(f"baseline, {minutes / 5:.0f} min, nothing holding the horizon:")
    baseline = churn(minutes * 60 / 5, from_head)
    stop = threading.Event()
    holder = threading.Thread(target=hold_snapshot, args=(stop,))
    holder.start()
    try:
        print(f"{minutes:.0f} min with a REPEATABLE READ transaction open:")
        held = churn(minutes * 60, from_head)
    finally:
        stop.set()
        holder.join()
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT n_dead_tup, n_live_tup FROM pg_stat_user_tables WHERE relname = %s",
            ["django_txqueue_queueitem"],
        )
        dead, live = cursor.fetchone()
    first = sum(baseline) / len(baseline)
    print(
        f"baseline {first:,.0f} claims/s; last window held {held[-1]:,.0f} claims/s"
        f" ({held[-1] / first:.0%}); worst held window {min(held) / first:.0%};"
        f" dead tuples at the end {dead:,} (live {live:,})"
    )


if __name__ == "__main__":
    main()
