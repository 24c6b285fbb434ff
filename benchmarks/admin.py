"""The admin at scale: fill the queue table with ROWS items and time every admin page.

    PYTHONPATH=. DJANGO_SETTINGS_MODULE=tests.settings TXQUEUE_TEST_DB=postgresql \\
        python -m benchmarks.admin [ROWS] [--keep] [-v]

Issue 13: with 1,000,000 items (99% DONE, the rest READY / IN_PROGRESS, some of them stuck /
FAILED, over 20 queues) every page, filter and search answers in under 300 ms. The table is
filled by the server itself (PostgreSQL: INSERT ... SELECT FROM generate_series; MariaDB:
INSERT ... SELECT FROM the Sequence engine's seq_1_to_N), then analyzed. Each page is fetched
once to warm up, then 5 times; the median, the query count and the slowest query are printed.
The dashboard's queries are timed on their own too, so its indexes are chosen now.

Uses its own database, ``txqueue_bench_admin``, kept afterwards: with --keep a second run
reuses the filled table. Drop it by hand when done. -v prints each URL.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from .database import prepare_database

VENDOR = os.environ.get("TXQUEUE_TEST_DB", "postgresql")
DB_NAME = "txqueue_bench_admin"
BUDGET_MS = 300
QUEUES = 20
# Of every 1000 items: 4 READY, 2 IN_PROGRESS with a live consumer, 1 with an expired lease,
# 1 whose consumer is dead, 3 FAILED; the other 989 DONE.
LIVE, DEAD = "bench:1:live", "bench:2:dead"


# The columns filled and each one's SQL for item n; {text} is n as text, {json} wraps a
# JSON text, {ago} is n's moment (one second apart, the last one now), {hour_ago} and
# {in_an_hour} are the clock; each put in per vendor.
COLUMNS = {
    "queue": "CONCAT('queue-', LPAD({text_q}, 2, '0'))",
    "payload": "{json_open}CONCAT('{{\"n\": ', {text}, '}}'){json_close}",
    "priority": "0",
    "run_at": "{ago}",
    "key": "CONCAT('key-', {text})",
    "dedup_key": "CASE WHEN n % 2 = 0 THEN CONCAT('dedup-', {text}) END",
    "max_attempts": "5",
    "last_error": "CASE WHEN n % 1000 BETWEEN 8 AND 10 THEN 'boom' ELSE '' END",
    "error_class": "''",
    "created_at": "{ago}",
    "finished_at": "CASE WHEN n % 1000 >= 8 THEN {ago} END",
    "status": (
        "CASE WHEN n % 1000 < 4 THEN 1 WHEN n % 1000 < 8 THEN 2"
        " WHEN n % 1000 < 11 THEN 4 ELSE 3 END"
    ),
    "pid": (
        f"CASE WHEN n % 1000 BETWEEN 4 AND 6 THEN '{LIVE}'"
        f" WHEN n % 1000 = 7 THEN '{DEAD}' ELSE '' END"
    ),
    "claim_token": "CASE WHEN n % 1000 BETWEEN 4 AND 7 THEN n END",
    "attempts": "CASE WHEN n % 1000 < 4 THEN 0 ELSE 1 END",
    "claimed_at": "CASE WHEN n % 1000 >= 4 THEN {ago} END",
    # n % 1000 == 6: the lease ran out an hour ago; the other claims hold theirs an hour more.
    "lease_expires_at": (
        "CASE WHEN n % 1000 = 6 THEN {hour_ago} WHEN n % 1000 BETWEEN 4 AND 7"
        " THEN {in_an_hour} END"
    ),
}


def fill(rows: int) -> None:
    """``rows`` items written by the server in one INSERT ... SELECT, then analyzed."""
    from datetime import timedelta

    from django.db import connection
    from django.utils import timezone

    from django_txqueue.models import Consumer, QueueItem

    rows = int(rows)  # it goes into the SQL text below: an int, never anything else
    table = connection.ops.quote_name(QueueItem._meta.db_table)
    if VENDOR == "postgresql":
        sql = {
            "text": "CAST(n AS TEXT)",
            "text_q": "CAST(n % 20 AS TEXT)",
            "json_open": "CAST(",
            "json_close": " AS JSONB)",
            "ago": f"now() - make_interval(secs => {rows} - n)",
            "hour_ago": "now() - interval '1 hour'",
            "in_an_hour": "now() + interval '1 hour'",
        }
        source = f"generate_series(1, {rows}) AS n"
    else:
        sql = {
            "text": "CAST(n AS CHAR)",
            "text_q": "CAST(n % 20 AS CHAR)",
            "json_open": "",
            "json_close": "",
            "ago": f"NOW(6) - INTERVAL ({rows} - n) SECOND",
            "hour_ago": "NOW(6) - INTERVAL 1 HOUR",
            "in_an_hour": "NOW(6) + INTERVAL 1 HOUR",
        }
        # The Sequence engine's virtual table seq_1_to_N, its column renamed n.
        source = f"(SELECT seq AS n FROM seq_1_to_{rows}) AS s"
    names = ", ".join(connection.ops.quote_name(name) for name in COLUMNS)
    values = ", ".join(expression.format(**sql) for expression in COLUMNS.values())
    Consumer.objects.all().delete()
    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE TABLE {table}")
        cursor.execute(f"INSERT INTO {table} ({names}) SELECT {values} FROM {source}")
    Consumer.objects.create(identity=LIVE, host="bench", os_pid=1, queues=["queue-00"])
    Consumer.objects.create(
        identity=DEAD,
        host="bench",
        os_pid=2,
        last_heartbeat_at=timezone.now() - timedelta(hours=1),
    )
    analyze()


def analyze() -> None:
    from django.db import connection

    from django_txqueue.models import Consumer, QueueItem

    with connection.cursor() as cursor:
        for model in (QueueItem, Consumer):
            table = connection.ops.quote_name(model._meta.db_table)
            if VENDOR == "postgresql":
                cursor.execute(f"VACUUM ANALYZE {table}")
            else:
                cursor.execute(f"ANALYZE TABLE {table}")
                cursor.fetchall()


def timed(run: Callable[[], Any]) -> tuple[float, float, int, str]:
    """After a warm-up, 5 runs: the median ms, the median ms spent in the database, the
    query count, and the slowest query of the last run with its ms."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    run()
    times, db_times = [], []
    for _ in range(5):
        with CaptureQueriesContext(connection) as queries:
            started = time.perf_counter()
            run()
            times.append((time.perf_counter() - started) * 1000)
        db_times.append(sum(float(q["time"]) for q in queries.captured_queries) * 1000)
    slowest = max(queries.captured_queries, key=lambda q: float(q["time"]), default=None)
    sql = f"{float(slowest['time']) * 1000:.0f}: {slowest['sql']}" if slowest else ""
    return statistics.median(times), statistics.median(db_times), len(queries), sql


def pages() -> list[tuple[str, str]]:
    from urllib.parse import urlencode

    from django.urls import reverse

    from django_txqueue.models import QueueItem

    items = reverse("admin:django_txqueue_queueitem_changelist")
    some = QueueItem.objects.filter(status=3).order_by("-pk").values_list("pk", "key")[500]
    dedup = QueueItem.objects.filter(pk=some[0] - some[0] % 2).values_list("dedup_key", flat=True)[
        0
    ]
    admin = "/admin/django_txqueue/"
    return [
        ("items", items),
        ("status: ready", items + "?status__exact=1"),
        ("status: in progress", items + "?status__exact=2"),
        ("status: done", items + "?status__exact=3"),
        ("status: failed", items + "?status__exact=4"),
        ("queue filter", items + "?queue=queue-07"),
        ("queue + failed", items + "?queue=queue-07&status__exact=4"),
        ("stuck: yes", items + "?stuck=yes"),
        ("stuck: no", items + "?stuck=no"),
        ("search: id", items + "?q=" + str(some[0])),
        ("search: key", items + "?q=" + some[1]),
        ("search: dedup_key", items + "?q=" + dedup),
        ("item detail", reverse("admin:django_txqueue_queueitem_change", args=[some[0]])),
        ("consumers", reverse("admin:django_txqueue_consumer_changelist")),
        ("in flight of a consumer", items + "?" + urlencode({"pid": LIVE, "status__exact": 2})),
        ("stuck page", admin + "queueitem/stuck/"),
        ("dashboard", admin + "dashboard/"),
        ("dashboard fragment", admin + "dashboard/?fragment=1"),
    ]


def dashboard_queries() -> list[tuple[str, Callable[[], Any]]]:
    """What the dashboard reads, as plain querysets; then the changelist's page query
    with and without the per-row stuck annotation of QueueItemAdmin.get_queryset."""
    from datetime import timedelta

    from django.contrib import admin
    from django.contrib.auth.models import User
    from django.db.models import Count, Min, Q
    from django.db.models.functions import TruncMinute
    from django.test import RequestFactory
    from django.utils import timezone

    from django_txqueue import Queue
    from django_txqueue.models import QueueItem, Status

    hour_ago = timezone.now() - timedelta(hours=1)
    items = QueueItem.objects.order_by()
    unfinished = [Status.READY, Status.IN_PROGRESS, Status.FAILED]
    request = RequestFactory().get("/")
    request.user = User.objects.get(username="bench")
    annotated = admin.site._registry[QueueItem].get_queryset(request).order_by("-pk")
    return [
        (
            "counts per queue and state, status__in=[1, 2, 4]",
            lambda: list(
                items.filter(status__in=unfinished)
                .values("queue", "status")
                .annotate(n=Count("pk"))
            ),
        ),
        # The same as an OR of equalities: PostgreSQL then combines the three partial
        # indexes (a BitmapOr), where it scans the table for the IN list.
        (
            "counts per queue and state, status=1 | status=2 | status=4",
            lambda: list(
                items.filter(
                    Q(status=Status.READY) | Q(status=Status.IN_PROGRESS) | Q(status=Status.FAILED)
                )
                .values("queue", "status")
                .annotate(n=Count("pk"))
            ),
        ),
        (
            "stuck per queue",
            lambda: list(items.stuck().values("queue").annotate(n=Count("pk"))),
        ),
        (
            "oldest due READY per queue",
            lambda: list(items.ready().values("queue").annotate(oldest=Min("run_at"))),
        ),
        (
            "throughput: done and failed per minute, last hour",
            lambda: list(
                items.filter(finished_at__gte=hour_ago, status__in=[Status.DONE, Status.FAILED])
                .annotate(minute=TruncMinute("finished_at"))
                .values("minute", "status")
                .annotate(n=Count("pk"))
            ),
        ),
        ("Queue.stats() of one queue (1/20 of the rows)", lambda: Queue("queue-01").stats()),
        ("page of 100 rows, no stuck annotation", lambda: list(items.order_by("-pk")[:100])),
        ("page of 100 rows, with the stuck annotation", lambda: list(annotated[:100])),
        (
            "page of 100 IN_PROGRESS rows, with the stuck annotation",
            lambda: list(annotated.filter(status=Status.IN_PROGRESS)[:100]),
        ),
    ]


def main() -> None:
    args = [arg for arg in sys.argv[1:] if not arg.startswith("--")]
    rows = int(args[0]) if args else 1_000_000
    if VENDOR not in ("postgresql", "mysql"):
        raise SystemExit("The admin bench runs on postgresql or mysql (TXQUEUE_TEST_DB).")
    prepare_database(VENDOR, DB_NAME)
    from django.conf import settings
    from django.contrib.auth.models import User
    from django.test import Client

    from django_txqueue.models import QueueItem

    # The test client's host; not setup_test_environment(), whose instrumented template
    # rendering would slow each page down beyond what a real server sees.
    settings.ALLOWED_HOSTS = ["testserver"]

    present = QueueItem.objects.count()
    if "--keep" in sys.argv and present:
        print(f"{VENDOR}: keeping the {present:,} items already in {DB_NAME}")
    else:
        started = time.perf_counter()
        fill(rows)
        took = time.perf_counter() - started
        print(f"{VENDOR}: filled {rows:,} items in {took:.1f} s (INSERT ... SELECT, ANALYZE)")
    user = User.objects.filter(username="bench").first() or User.objects.create_superuser(
        "bench", "bench@example.com", "bench"
    )
    client = Client()
    client.force_login(user)
    print(f"rows in the table: {QueueItem.objects.count():,}")
    print(f"\n{'page':<26} {'ms':>7} {'db ms':>7} {'queries':>7}  {'<300 ms':<11} slowest query")
    for name, url in pages():
        status = client.get(url).status_code
        # Not built yet: a 404, or the change view taking "stuck" for an id and redirecting.
        if status in (404, 302):
            print(f"{name:<26} {'':>7} {'':>7} {'':>7}  not present")
            continue
        assert status == 200, (url, status)
        ms, db_ms, count, slowest = timed(lambda url=url: client.get(url))
        verdict = "pass" if ms < BUDGET_MS else "FAIL"
        print(f"{name:<26} {ms:>7.1f} {db_ms:>7.1f} {count:>7}  {verdict:<11} {slowest[:90]}")
        if "-v" in sys.argv:
            print(f"{'':<26} {url}")
    print(f"\n{'query':<58} {'ms':>7}  {'<300 ms'}")
    for name, run in dashboard_queries():
        ms, _, _, _ = timed(run)
        verdict = "pass" if ms < BUDGET_MS else "FAIL"
        print(f"{name:<58} {ms:>7.1f}  {verdict}")


if __name__ == "__main__":
    main()
