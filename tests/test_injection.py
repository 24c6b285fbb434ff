"""SQL injection: hostile strings through every way in are stored and matched verbatim.

Each string below would break out of a quoted literal or an identifier, end the statement or
comment the rest out if any SQL were built by formatting it in. They go through queue names,
keys, dedup keys, payload keys and values, results, the admin's search and filters, and the
management commands' arguments; afterwards the table must hold every row it held, and each
string must read back byte for byte.
"""

import io
import json

import pytest
from django.core.management import call_command
from django.db import connection
from django.urls import reverse

from django_txqueue import Queue, Status, enqueue
from django_txqueue.models import Consumer, QueueItem
from django_txqueue.store import Ack

HOSTILE = [
    "x'; DROP TABLE django_txqueue_queueitem; --",
    'x"; DROP TABLE django_txqueue_queueitem; --',
    "x` OR 1=1; --",
    "' OR '1'='1",
    "%s %(name)s {0} ?",
    "\\'; SELECT pg_sleep(5); --",
    "x') UNION SELECT id, queue FROM django_txqueue_queueitem --",
    "x\\0y",  # a NUL escape (PostgreSQL text refuses NUL itself)
    "é'ü\"; /* */ --",
]
ITEMS = reverse("admin:django_txqueue_queueitem_changelist")


@pytest.fixture
def bystander(db):
    """An item of another queue that must come through untouched."""
    return enqueue("bystander", {"keep": True})


def table_intact(bystander, expected_rows):
    assert QueueItem.objects.count() == expected_rows
    assert QueueItem.objects.get(pk=bystander.pk).payload == {"keep": True}


@pytest.mark.parametrize("hostile", HOSTILE)
def test_queue_names_keys_and_payloads_are_stored_verbatim(hostile, bystander):
    item = Queue(hostile[:100]).enqueue(
        {hostile: hostile, "list": [hostile]}, key=hostile, dedup_key=hostile
    )
    stored = QueueItem.objects.get(pk=item.pk)
    assert (stored.queue, stored.key, stored.dedup_key) == (hostile[:100], hostile, hostile)
    assert stored.payload == {hostile: hostile, "list": [hostile]}
    # The same strings find the row again: matched as values, not as SQL.
    assert Queue(hostile[:100]).count() == 1
    assert Queue(hostile[:100]).enqueue({}, dedup_key=hostile).pk == item.pk  # its twin
    table_intact(bystander, 2)


@pytest.mark.parametrize("hostile", HOSTILE)
def test_claims_acknowledgements_and_results(hostile, bystander):
    queue = Queue(hostile[:100])
    queue.enqueue_many([{"n": 1}, {"n": 2}], key=hostile)
    claimed = queue.claim(2, pid=hostile[:255])
    assert [item.pid for item in claimed] == [hostile[:255]] * 2
    assert claimed[0].ack({hostile: hostile})
    acknowledged, _ = queue.claims.ack_and_claim(
        Ack(claimed[1].claim_token, {claimed[1].pk: hostile})
    )
    assert acknowledged == 1
    results = {json.dumps(value) for value in queue.items.values_list("result", flat=True)}
    assert results == {json.dumps({hostile: hostile}), json.dumps(hostile)}
    assert queue.count(Status.DONE) == 2
    table_intact(bystander, 3)


@pytest.mark.parametrize("hostile", HOSTILE)
def test_admin_search_and_filters(hostile, bystander, admin_client):
    item = enqueue(hostile[:100], {}, key=hostile)
    for query in ({"q": hostile}, {"queue": hostile[:100]}, {"q": hostile, "status": "1"}):
        response = admin_client.get(ITEMS, query)
        assert response.status_code == 200
        assert {row.pk for row in response.context["cl"].result_list} == {item.pk}
    consumers = reverse("admin:django_txqueue_consumer_changelist")
    assert admin_client.get(consumers, {"q": hostile}).status_code == 200
    table_intact(bystander, 2)


@pytest.mark.parametrize("hostile", HOSTILE)
def test_command_arguments(hostile, bystander):
    name = hostile[:100]
    Queue(name).enqueue({})
    out = io.StringIO()
    call_command("txqueue_stats", name, "--json", stdout=out)
    (stats,) = json.loads(out.getvalue())
    assert (stats["queue"], stats["ready"]) == (name, 1)
    call_command("txqueue_requeue_stuck", name, stdout=io.StringIO())
    call_command("txqueue_purge", name, "--older-than", "0", stdout=io.StringIO())
    assert Queue(name).count() == 1  # READY: not purged
    table_intact(bystander, 2)


@pytest.mark.django_db(transaction=True)
def test_a_consumer_serves_a_hostile_queue_name():
    from django_txqueue.consumer.worker import Worker

    name = HOSTILE[0]
    Queue(name).enqueue_many([{"n": n} for n in range(3)])
    worker = Worker(handlers={name: lambda item: item.queue}, burst=True)
    worker.run()
    assert worker.processed == 3
    assert set(Queue(name).items.values_list("result", flat=True)) == {name}
    assert Consumer.objects.get(identity=worker.identity).queues[0] == name
    with connection.cursor() as cursor:  # the table is still there, whole
        cursor.execute(f"SELECT COUNT(*) FROM {QueueItem._meta.db_table}")
        assert cursor.fetchone()[0] == 3
