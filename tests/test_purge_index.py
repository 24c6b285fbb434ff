"""The purge reads the rows it deletes through their index (finished_at, recorded_at),
oldest first, not the table in primary-key order.

A walk of the primary keys finds the few old rows only after reading past every younger
and unfinished one: SQLite plans it that way, so every purge (at each consumer's start,
then every PURGE_INTERVAL) read the whole table, 105 MB and 110-180 ms at 1,000,000
rows, in the middle of the consumer's claims (docs/benchmarks.md, "Claim rate as the
table grows")."""

import datetime as dt
import time

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_txqueue import Queue, store
from django_txqueue.models import Effect, QueueItem
from tests.helpers import finished_items

OLD = dt.timedelta(days=10)


def purge_select(run) -> str:
    """The first SELECT ``run()`` sends, its values inlined (Django's SQLite captures it
    so)."""
    with CaptureQueriesContext(connection) as queries:
        run()
    return next(q["sql"] for q in queries.captured_queries if q["sql"].startswith("SELECT"))


def plan(sql: str) -> str:
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN QUERY PLAN {sql}")
        return " | ".join(str(row[-1]) for row in cursor.fetchall())


@pytest.mark.skipif(connection.vendor != "sqlite", reason="SQLite's plan")
@pytest.mark.parametrize("analyzed", [False, True], ids=["fresh", "analyzed"])
@pytest.mark.parametrize("queues", [["a"], ["a", "b", "c"]], ids=["one queue", "several"])
def test_sqlite_purges_through_the_finished_at_index(db, analyzed, queues):
    # Several: a consumer purges the queues it serves that are kept alike together.
    Queue("a").enqueue_many([{}] * 300)  # READY rows the purge must not read
    finished_items("a", 3, ago=dt.timedelta(hours=1))
    if analyzed:
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE")
    items = QueueItem.objects.filter(queue__in=queues)
    sql = purge_select(lambda: store.purge(items, dt.timedelta(days=1)))
    found = plan(sql)
    assert "txqueue_item_finished" in found, found
    assert "PRIMARY KEY" not in found and "TEMP B-TREE" not in found, found


@pytest.mark.skipif(connection.vendor != "sqlite", reason="SQLite's plan")
def test_sqlite_purges_once_records_through_the_recorded_at_index(db):
    Effect.objects.bulk_create([Effect(key=f"k{n}") for n in range(300)])
    sql = purge_select(lambda: store.purge_effects(Effect.objects.all(), OLD))
    found = plan(sql)
    assert "recorded_at" in found, found
    assert "PRIMARY KEY" not in found and "TEMP B-TREE" not in found, found


def test_the_oldest_finished_go_first(db, monkeypatch):
    """A purge cut short deletes the items that finished longest ago, whatever their pks."""
    monkeypatch.setattr(store.upkeep, "PURGE_BATCH", 2)
    younger = finished_items("a", 2, ago=dt.timedelta(days=3))
    oldest = finished_items("a", 2, ago=dt.timedelta(days=9))  # higher pks, finished first
    older = finished_items("a", 2, ago=dt.timedelta(days=5))
    assert store.purge(Queue("a").items, dt.timedelta(days=1), until=time.monotonic() - 1) == 2
    assert set(Queue("a").items.values_list("pk", flat=True)) == younger | older
    assert store.purge(Queue("a").items, dt.timedelta(days=1)) == 4
    assert not QueueItem.objects.filter(pk__in=oldest | younger | older).exists()


def test_the_oldest_once_records_go_first(db, monkeypatch):
    monkeypatch.setattr(store.upkeep, "PURGE_BATCH", 1)
    for key, ago in (("young", 2), ("oldest", 9), ("old", 5)):
        Effect.objects.create(key=key)
        Effect.objects.filter(key=key).update(recorded_at=timezone.now() - dt.timedelta(days=ago))
    assert store.purge_effects(Effect.objects.all(), OLD / 10, until=time.monotonic() - 1) == 1
    assert set(Effect.objects.values_list("key", flat=True)) == {"young", "old"}
