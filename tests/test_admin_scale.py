"""The admin at scale, as far as a test can show it (benchmarks/admin.py times a million
rows): a changelist's query count does not grow with its rows, the unfiltered list is
counted from the statistics on PostgreSQL and MariaDB, filtered ones exactly, and the
queue filter offers exactly the queues present."""

import datetime as dt

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from django_txqueue import Queue, Status
from django_txqueue.admin import EstimatedCountPaginator
from django_txqueue.models import Consumer, QueueItem
from tests import helpers
from tests.helpers import has

ITEMS = reverse("admin:django_txqueue_queueitem_changelist")


def fill(queue, count, status=Status.DONE):
    Queue(queue).enqueue_many([{"n": n} for n in range(count)])
    QueueItem.objects.filter(queue=queue).update(status=status)


def analyze():
    """Bring the table's statistics up to date where the database keeps them. MariaDB's
    ANALYZE TABLE commits: only for tests with transaction=True."""
    if has("statistics"):
        helpers.analyze(QueueItem)


def counts(queries):
    return [q["sql"] for q in queries.captured_queries if "COUNT(" in q["sql"].upper()]


def queue_choices(response):
    """The queue filter's choices; with none, Django leaves the filter out."""
    specs = [s for s in response.context["cl"].filter_specs if s.title == "queue"]
    return [name for spec in specs for name, _ in spec.lookup_choices]


def page(client, query=None):
    with CaptureQueriesContext(connection) as queries:
        response = client.get(ITEMS, query or {})
    assert response.status_code == 200
    return response, queries


def test_changelist_queries_do_not_grow_with_its_rows(admin_client, db):
    """No N+1: 5 rows or 100 (a full page, stuck ones among them), the same queries."""
    Consumer.objects.create(
        identity="h:1:dead",
        host="h",
        os_pid=1,
        last_heartbeat_at=timezone.now() - dt.timedelta(hours=1),
    )
    fill("a", 5)
    _, few = page(admin_client)
    fill("b", 95, Status.IN_PROGRESS)
    QueueItem.objects.filter(queue="b").update(pid="h:1:dead")
    response, many = page(admin_client)
    assert len(response.context["cl"].result_list) == 100
    assert "in progress, stuck" in response.content.decode()
    assert len(many) == len(few)


@pytest.mark.requires("statistics")
@pytest.mark.django_db(transaction=True)  # MariaDB's ANALYZE TABLE commits
def test_unfiltered_changelist_counts_from_the_statistics(admin_client, monkeypatch):
    monkeypatch.setattr(EstimatedCountPaginator, "exact_up_to", 20)
    fill("a", 150)
    analyze()
    response, queries = page(admin_client)
    assert counts(queries) == []
    assert response.context["cl"].result_count > 20  # the estimate
    assert len(response.context["cl"].result_list) == 100


@pytest.mark.django_db(transaction=True)
def test_a_small_table_is_counted_exactly(admin_client):
    fill("a", 30)
    analyze()
    response, queries = page(admin_client)
    assert response.context["cl"].result_count == 30


def test_filtered_changelist_counts_exactly(admin_client, db):
    fill("a", 120)
    fill("b", 7, Status.FAILED)
    response, queries = page(admin_client, {"status__exact": Status.FAILED.value})
    assert counts(queries)
    assert response.context["cl"].result_count == 7
    response, _ = page(admin_client, {"queue": "a"})
    assert response.context["cl"].result_count == 120


def test_a_large_filtered_count_stops_at_its_bound(admin_client, db, monkeypatch):
    """Past exact_up_to rows the planner's estimate stands in, never below the rows
    counted: a page of 990,000 DONE rows does not count them all."""
    monkeypatch.setattr(EstimatedCountPaginator, "exact_up_to", 10)
    fill("a", 40)
    response, queries = page(admin_client, {"status__exact": Status.DONE.value})
    assert response.context["cl"].result_count >= 11
    first, *others = counts(queries)
    assert "LIMIT 11" in first.upper()
    # Past the bound, an EXPLAIN; SQLite has no estimate and counts them all.
    assert others == [] if has("statistics") else len(others) == 1


def test_queue_filter_lists_exactly_the_queues_present(admin_client, db):
    for queue in ("zeta", "alpha", "mid", "gone"):
        fill(queue, 3)
    QueueItem.objects.filter(queue="gone").delete()
    response, _ = page(admin_client)
    assert queue_choices(response) == ["alpha", "mid", "zeta"]


def test_queue_filter_with_no_items(admin_client, db):
    response, _ = page(admin_client)
    assert queue_choices(response) == []
