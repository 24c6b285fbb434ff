"""The bad-input matrix: ``BAD_CALLS`` holds 46 calls across the API, on_commit
and the management commands, each run against a table with a READY, a claimed and a DONE
item; each must raise an error that names its problem and leave every row as it was,
the claimed item still IN_PROGRESS under its claim. Beside it, edge input with its own
checks: a huge payload, the end of time, a database alias that does not exist, and the
admin's query string taken apart.

The rest of the bad-input matrix lives beside the code it exercises: test_api.py (payload,
names, times, numbers, strategies, leases), test_validation.py, test_checks.py (TXQUEUE
keys, types and values), test_commands.py (unknown queues, bad numbers, unknown aliases, a
database not migrated), test_backends.py (Django Tasks), test_worker.py (handlers that
raise, hang past TIMEOUT, return non-JSON, raise SystemExit or KeyboardInterrupt) and
tests/e2e/test_startup.py (a database down when a consumer starts).
"""

import datetime as dt
import re

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.urls import reverse
from django.utils import timezone
from django.utils.connection import ConnectionDoesNotExist

from django_txqueue import Queue, Status, enqueue, on_commit
from django_txqueue.consumer.worker import Worker
from django_txqueue.models import QueueItem

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
    end = dt.datetime(9999, 12, 31, 23, 59, 59, tzinfo=dt.UTC)
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


# -- the matrix: every bad call names its problem and changes nothing -----------------


def _later(name):
    """A module-level function for on_commit (a lambda is refused)."""


@pytest.fixture
def world(db):
    """A READY, an IN_PROGRESS (claimed: returned) and a DONE item, in queue "m"."""
    queue = Queue("m")
    queue.enqueue_many([{"n": n} for n in range(3)])
    running, done = queue.claim(2)
    assert done.ack()
    return running


def rows():
    """Every item row as it stands: what a bad call must leave untouched."""
    fields = ("pk", "queue", "status", "claim_token", "attempts", "payload", "run_at", "result")
    return list(QueueItem.objects.order_by("pk").values_list(*fields))


def command(name, *args):
    return lambda running: call_command(name, *args, verbosity=0)


AWARE = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
BAD_CALLS = [
    # (case, call, exception, message)
    ("payload object", lambda r: enqueue("m", object()), TypeError, "object"),
    ("payload set", lambda r: enqueue("m", {1, 2}), TypeError, "set"),
    ("payload tuple key", lambda r: enqueue("m", {(1, 2): 3}), TypeError, "keys"),
    ("payload bytes", lambda r: enqueue("m", b"x"), TypeError, "bytes"),
    ("empty queue name", lambda r: enqueue("", {}), ValueError, "queue name"),
    ("101-char queue name", lambda r: enqueue("q" * 101, {}), ValueError, "100"),
    ("queue name not a str", lambda r: enqueue(None, {}), TypeError, "queue name"),
    ("naive run_at", lambda r: enqueue("m", {}, run_at=dt.datetime(2030, 1, 1)), ValueError,
     "naive"),
    ("run_at not a datetime", lambda r: enqueue("m", {}, run_at="tomorrow"), TypeError,
     "run_at"),
    ("run_at and delay", lambda r: enqueue("m", {}, run_at=AWARE, delay=5), ValueError,
     "run_at or delay"),
    ("negative delay", lambda r: enqueue("m", {}, delay=-1), ValueError, "delay"),
    ("priority a str", lambda r: enqueue("m", {}, priority="1"), (TypeError, ValueError),
     "priority"),
    ("priority past int32", lambda r: enqueue("m", {}, priority=2**40), ValueError,
     "priority"),
    ("max_attempts 0", lambda r: enqueue("m", {}, max_attempts=0), ValueError,
     "max_attempts"),
    ("empty key", lambda r: enqueue("m", {}, key=""), ValueError, "key"),
    ("256-char key", lambda r: enqueue("m", {}, key="k" * 256), ValueError, "key"),
    ("dedup_key an int", lambda r: enqueue("m", {}, dedup_key=7), TypeError, "dedup_key"),
    ("enqueue_many with dedup_key", lambda r: Queue("m").enqueue_many([{}], dedup_key="d"),
     ValueError, "dedup_key"),
    ("enqueue_many, one bad payload", lambda r: Queue("m").enqueue_many([{}, object()]),
     TypeError, "object"),
    ("fair queue, no key", lambda r: enqueue("fair", {}), ValueError, "needs a key"),
    ("claim 0", lambda r: Queue("m").claim(0), ValueError, "limit"),
    ("claim -1", lambda r: Queue("m").claim(-1), ValueError, "limit"),
    ("claim a str", lambda r: Queue("m").claim("5"), ValueError, "limit"),
    ("claim True", lambda r: Queue("m").claim(True), ValueError, "limit"),
    ("unknown strategy", lambda r: Queue("m").claim(1, strategy="fastest"), ValueError,
     "skip_locked"),
    ("negative lease", lambda r: Queue("m").claim(1, lease=-1), ValueError, "lease"),
    ("lease a str", lambda r: Queue("m").claim(1, lease="soon"), TypeError, "lease"),
    ("256-char pid", lambda r: Queue("m").claim(1, pid="p" * 256), ValueError, "pid"),
    ("ack with a non-JSON result", lambda r: r.ack(result=object()), TypeError, "object"),
    ("retry with a negative delay", lambda r: r.retry("e", delay=-1), ValueError, "delay"),
    ("purge older than -1 s", lambda r: Queue("m").purge(-1), ValueError, "older_than"),
    ("on_commit of a lambda", lambda r: on_commit(lambda: None), ValueError, "module-level"),
    ("on_commit of non-JSON args", lambda r: on_commit(_later, object()), TypeError,
     "object"),
    ("consumer, unknown queue", command("run_queue_consumer", "nosuch", "--burst"),
     CommandError, "nosuch"),
    ("consumer, batch 0", command("run_queue_consumer", "echo", "--batch", "0"),
     CommandError, "batch"),
    ("consumer, concurrency -1", command("run_queue_consumer", "echo", "--concurrency", "-1"),
     CommandError, "concurrency"),
    ("consumer, lease -5", command("run_queue_consumer", "echo", "--lease", "-5"),
     CommandError, "lease"),
    ("consumer, lease nan", command("run_queue_consumer", "echo", "--lease", "nan"),
     CommandError, "lease"),
    ("consumer, shutdown timeout 0",
     command("run_queue_consumer", "echo", "--shutdown-timeout", "0"), CommandError,
     "shutdown-timeout"),
    ("consumer, unknown strategy",
     command("run_queue_consumer", "echo", "--strategy", "fastest"), CommandError,
     "strategy"),
    ("consumer, unknown database", command("run_queue_consumer", "echo", "--database", "nope"),
     CommandError, "nope"),
    ("purge, negative days", command("txqueue_purge", "--older-than", "-1"), CommandError,
     "older-than"),
    ("purge, days not a number", command("txqueue_purge", "--older-than", "soon"),
     CommandError, "older"),
    ("stats, bad queue name", command("txqueue_stats", "q" * 101), CommandError, "100"),
    ("requeue, unknown database", command("txqueue_requeue_stuck", "--database", "nope"),
     CommandError, "nope"),
    ("bench, unknown part", command("txqueue_bench", "--only", "nap"), CommandError,
     "--only takes"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("call", "exception", "message"),
    [pytest.param(call, exc, msg, id=case) for case, call, exc, msg in BAD_CALLS],
)
def test_a_bad_call_names_the_problem_and_changes_nothing(world, call, exception, message):
    before = rows()
    with pytest.raises(exception, match=re.escape(message)):
        call(world)
    assert rows() == before
    assert QueueItem.objects.filter(status=Status.IN_PROGRESS).get().pk == world.pk
    assert connection.is_usable()
