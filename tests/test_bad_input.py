"""Edge input that the other modules' matrices leave out: a huge payload, the end of time,
a database alias that does not exist, and the admin's query string taken apart.

The rest of the bad-input matrix lives beside the code it exercises: test_api.py (payload,
names, times, numbers, strategies, leases), test_validation.py, test_checks.py (TXQUEUE
keys, types and values), test_commands.py (unknown queues, bad numbers, unknown aliases, a
database not migrated), test_backends.py (Django Tasks), test_worker.py (handlers that
raise, hang past TIMEOUT, return non-JSON, raise SystemExit or KeyboardInterrupt) and
tests/e2e/test_startup.py (a database down when a consumer starts).
"""

import datetime as dt

import pytest
from django.db import connection
from django.urls import reverse
from django.utils import timezone
from django.utils.connection import ConnectionDoesNotExist

from django_txqueue import Queue, Status, enqueue
from django_txqueue.models import QueueItem
from django_txqueue.worker import Worker

ITEMS = reverse("admin:django_txqueue_queueitem_changelist")


@pytest.mark.django_db(transaction=True)
def test_a_10_mb_payload_goes_through_whole():
    """No limit of the queue's own: the database's (README, "Payloads")."""
    text = "x" * (10 * 1024 * 1024)
    item = enqueue("big", {"text": text, "n": 1})
    seen = {}
    worker = Worker(handlers={"big": lambda claimed: seen.update(claimed.payload)}, burst=True)
    worker.run()
    assert worker.processed == 1
    assert seen == {"text": text, "n": 1}
    assert QueueItem.objects.get(pk=item.pk).status == Status.DONE


def test_the_end_of_time_is_a_valid_run_at_and_is_never_due(db):
    end = dt.datetime(9999, 12, 31, 23, 59, 59, tzinfo=dt.timezone.utc)
    item = Queue("later").enqueue({}, run_at=end)
    assert QueueItem.objects.get(pk=item.pk).run_at == end
    assert Queue("later").claim(5) == []


def test_an_unknown_database_alias_is_named_and_nothing_is_written(db):
    with pytest.raises(ConnectionDoesNotExist, match="'nope'"):
        enqueue("q", {}, using="nope")
    with pytest.raises(ConnectionDoesNotExist, match="'nope'"):
        Queue("q", using="nope").claim(1)
    assert QueueItem.objects.count() == 0


@pytest.mark.parametrize(
    "query",
    [
        {"status": "99"},
        {"status": "ready"},
        {"status__exact": "1; DROP TABLE x"},
        {"id__gt": "not a number"},
        {"run_at__gte": "yesterday"},
        {"stuck": "maybe"},
        {"o": "99"},
        {"p": "-1"},
        {"p": "9" * 30},
        {"q": "\x00"},
    ],
)
def test_the_admin_takes_a_bad_query_string_calmly(admin_client, query):
    item = enqueue("q", {})
    response = admin_client.get(ITEMS, query)
    # Django's admin answers an invalid lookup with the unfiltered page and "?e=1".
    assert response.status_code in (200, 302)
    if response.status_code == 302:
        assert response["Location"].endswith("?e=1")
    assert QueueItem.objects.get(pk=item.pk).status == Status.READY


def test_an_admin_action_on_ids_that_are_not_ids(admin_client):
    """A forged selection: Django's own filter would be a server error (ValueError)."""
    item = enqueue("q", {})
    for ids in (["x"], ["9" * 30], ["-1"], ["²"], ["1", "x"]):
        data = {"action": "requeue", "_selected_action": ids, "index": 0}
        response = admin_client.post(ITEMS, data, follow=True)
        assert response.status_code == 200
        assert "The selection holds a value that is no item id." in response.content.decode()
    assert QueueItem.objects.get(pk=item.pk).status == Status.READY
    assert connection.is_usable()


def test_an_aware_run_at_in_another_time_zone_means_the_same_instant(db):
    tokyo = dt.timezone(dt.timedelta(hours=9))
    when = timezone.now().astimezone(tokyo) + dt.timedelta(hours=1)
    item = Queue("tz").enqueue({}, run_at=when)
    assert QueueItem.objects.get(pk=item.pk).run_at == when
    assert Queue("tz").claim(1) == []
