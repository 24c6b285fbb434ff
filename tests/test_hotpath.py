"""The consumer's fast paths give handlers and signal receivers what the slow ones did.

Claimed rows are built without ``Model.__init__`` (``ClaimStatement.fetch``) and the signals are
only sent where someone listens: the handler must still get a real ``QueueItem`` equal,
field by field and type by type, to the row, and receivers the same arguments.
"""

import datetime
import decimal
import json
import re

import pytest
from django.db import DataError, connection, transaction
from django.db.models.signals import post_init
from django.test.utils import CaptureQueriesContext

from django_txqueue import Queue, Status, group, signals, step, store
from django_txqueue.consumer.worker import Worker
from django_txqueue.db import dialect
from django_txqueue.models import QueueItem
from django_txqueue.store import Ack
from tests.helpers import has

pytestmark = pytest.mark.django_db(transaction=True)

PAYLOAD = {
    "int": 7,
    "big": 2**53 + 1,
    "float": 1.5,
    "bool": True,
    "none": None,
    "text": "zürich ☃",
    "list": [1, "two", [3.0], {"four": False}],
    "nested": {"a": {"b": []}},
}


def drain(handlers, **options):
    worker = Worker(handlers=handlers, burst=True, **options)
    worker.run()
    return worker


def assert_same_as_row(item, row):
    assert type(item) is QueueItem
    for field in QueueItem._meta.concrete_fields:
        got, stored = getattr(item, field.attname), getattr(row, field.attname)
        assert type(got) is type(stored), field.name
        # The same time zone object as Django's own read gives (the claim's cursor may
        # read timestamps with psycopg's loader: db/postgresql.py, hot_cursor).
        assert getattr(got, "tzinfo", None) is getattr(stored, "tzinfo", None), field.name
        if field.name == "lease_expires_at":
            assert got <= stored  # the consumer's heartbeat may have renewed it since
        else:
            assert got == stored, field.name
    assert item._state.adding is False
    assert item._state.db == row._state.db == "default"


def run_and_compare(payload, **enqueue):
    """Run one item through a consumer; compare what its handler got with its row."""
    seen = {}

    def handle(item):
        seen["deferred"] = item.get_deferred_fields()
        with CaptureQueriesContext(connection) as reads:
            for field in item._meta.concrete_fields:
                if field.attname not in seen["deferred"]:
                    getattr(item, field.attname)
        seen["queries"] = len(reads)  # every field at hand: no query per item
        for name in seen["deferred"]:
            getattr(item, name)  # loaded now, while the row is as the claim left it
        seen["item"] = item
        seen["row"] = QueueItem.objects.get(pk=item.pk)  # as the claim left it
        return {"ok": payload}

    item = Queue("hotpath").enqueue(payload, **enqueue)
    drain({"hotpath": handle}, batch=5)
    assert seen["queries"] == 0
    # Without UPDATE ... RETURNING, MySQL's skip_locked claim reads the rows before its
    # UPDATE, which sets these two by the database clock: they load on access
    # (db/mysql.py, unchanged here).
    by_clock = set() if has("update_returning") else {"claimed_at", "lease_expires_at"}
    assert seen["deferred"] <= by_clock
    assert_same_as_row(seen["item"], seen["row"])
    assert seen["item"].payload == payload
    # json.dumps tells 1 from 1.0 and True, which == does not
    assert json.dumps(seen["item"].payload) == json.dumps(seen["row"].payload)
    assert seen["row"].status == Status.IN_PROGRESS
    done = QueueItem.objects.get(pk=item.pk)
    assert (done.status, done.result) == (Status.DONE, {"ok": payload})
    return seen["item"]


def test_the_handler_gets_every_field_of_the_row():
    item = run_and_compare(
        PAYLOAD,
        priority=-3,
        key="tenant-1",
        dedup_key="once",
        max_attempts=4,
        run_at=datetime.datetime(2020, 1, 2, 3, 4, 5, 678901, tzinfo=datetime.UTC),
    )
    assert (item.priority, item.key, item.dedup_key, item.attempts) == (-3, "tenant-1", "once", 1)
    assert item.claim_token and item.pid and item.claimed_at and item.lease_expires_at


@pytest.mark.parametrize("payload", [None, 0, "text", [1, 2.5, None], {"d": "1.10"}])
def test_json_payload_types_survive(payload):
    run_and_compare(payload)


def test_a_django_json_payload_arrives_as_stored():
    # DjangoJSONEncoder writes decimals and dates as strings: the handler reads strings.
    with pytest.raises(AssertionError):
        run_and_compare({"price": decimal.Decimal("1.10"), "when": datetime.date(2024, 5, 6)})
    handled = QueueItem.objects.get()
    assert handled.payload == {"price": "1.10", "when": "2024-05-06"}


def test_the_handler_can_save_and_refresh_its_item():
    def handle(item):
        item.last_error = "note"
        item.save(update_fields=["last_error"])
        item.refresh_from_db()
        assert item.last_error == "note"

    item = Queue("hotpath").enqueue({})
    drain({"hotpath": handle})
    assert QueueItem.objects.get(pk=item.pk).last_error == "note"


def test_a_post_init_receiver_still_sees_every_claimed_item():
    built = []

    def record(sender, instance, **kwargs):
        built.append(instance.pk)

    post_init.connect(record, sender=QueueItem)
    try:
        item = run_and_compare({"x": 1})
    finally:
        post_init.disconnect(record, sender=QueueItem)
    assert item.pk in built


def test_signal_receivers_get_what_they_got(settings):
    settings.TXQUEUE = {**settings.TXQUEUE, "RETRY_DELAY": 0.001, "RETRY_MAX_DELAY": 0.001}
    calls = []

    def record(name):
        def receive(signal, sender, **kwargs):
            calls.append((name, sender, kwargs))

        return receive

    receivers = {
        signals.item_claimed: record("claimed"),
        signals.item_done: record("done"),
        signals.item_failed: record("failed"),
    }
    handled = {}

    def handle(item):
        handled[item.payload["n"]] = item
        if item.payload["n"] == 1:
            raise RuntimeError("no")
        return item.payload["n"] * 10

    for signal, receiver in receivers.items():
        signal.connect(receiver, sender=QueueItem)  # sender-specific receivers count too
    try:
        Queue("hotpath").enqueue_many([{"n": 0}, {"n": 1}], max_attempts=1)
        worker = drain({"hotpath": handle}, batch=2)
    finally:
        for signal, receiver in receivers.items():
            signal.disconnect(receiver, sender=QueueItem)
    assert (worker.processed, worker.failed) == (1, 1)
    by_name = {}
    for name, sender, kwargs in calls:
        assert sender is QueueItem
        by_name.setdefault(name, []).append(kwargs)
    claimed = sorted(by_name["claimed"], key=lambda kwargs: kwargs["item"].payload["n"])
    assert [set(kwargs) for kwargs in claimed] == [{"item"}, {"item"}]
    assert [kwargs["item"] for kwargs in claimed] == [handled[0], handled[1]]
    assert claimed[0]["item"] is handled[0]  # the very object the handler got
    [done] = by_name["done"]
    assert set(done) == {"item", "result", "duration"}
    assert done["item"] is handled[0]
    assert done["result"] == 0
    assert done["duration"] >= 0
    [failed] = by_name["failed"]
    assert set(failed) == {"item", "error", "will_retry", "duration"}
    assert failed["item"] is handled[1]
    assert "RuntimeError: no" in failed["error"]
    assert failed["will_retry"] is False
    assert QueueItem.objects.get(pk=handled[1].pk).status == Status.FAILED


def test_without_receivers_nothing_is_sent(monkeypatch):
    sent = []
    for signal in (signals.item_claimed, signals.item_done, signals.item_failed):
        monkeypatch.setattr(signal, "send", lambda *args, **kwargs: sent.append(args))
    Queue("hotpath").enqueue_many([{"n": n} for n in range(3)])
    worker = drain({"hotpath": lambda item: None}, batch=3)
    assert worker.processed == 3
    assert sent == []


def test_a_large_batch_is_acknowledged_at_once_and_fenced():
    # Over 50 pks (PostgreSQL binds them as one array), one of them past 32 bits.
    items = Queue("hotpath").enqueue_many([{"n": n} for n in range(120)])
    QueueItem.objects.filter(pk=items[0].pk).update(id=2**40)
    claimed = Queue("hotpath").claim(120)
    assert len(claimed) == 120 and 2**40 in {item.pk for item in claimed}
    token = claimed[0].claim_token
    pks = {item.pk: None for item in claimed}
    assert store.ack_many(QueueItem, "default", Ack(token ^ 1, pks)) == 0  # another claim's token
    assert store.ack_many(QueueItem, "default", Ack(token, pks)) == 120
    assert Queue("hotpath").count(status=Status.DONE) == 120


def plain_statements(handlers):
    """The claims and acknowledgements a burst consumer of ``handlers`` sends while it
    drains 30 items of the plain queue "hotpath", each text once, their values made
    placeholders (the claim tokens, keys and times differ from run to run), but those
    that name another queue."""
    queue = Queue("hotpath")
    queue.items.delete()
    queue.enqueue_many([{"n": n} for n in range(30)])
    with CaptureQueriesContext(connection) as queries:
        drain(handlers, batch=10)
    done = queue.items.filter(status=Status.DONE).count()
    assert done == 30
    others = [name for name in handlers if name != "hotpath"]
    found = set()
    for query in queries.captured_queries:
        sql = query["sql"]
        # Its claims name the queue; an acknowledgement that does not ride with one names
        # only primary keys.
        ack = re.match(r'UPDATE [`"]django_txqueue_queueitem[`"] SET', sql) is not None
        if not (ack or "'hotpath'" in sql) or any(f"'{name}'" in sql for name in others):
            continue
        sql = re.sub(r"'(?:[^']|'')*'", "?", sql)
        sql = re.sub(r"\b\d+(\.\d+)?\b", "N", sql)
        found.add(re.sub(r"\((N, )*N\)", "(N, ...)", sql))
    return found


def test_features_of_other_queues_leave_a_plain_queues_statements_as_they_are(settings):
    """Rate limits, caps, time limits, progress, async handlers and flows on other queues:
    a plain queue is claimed and acknowledged by the very statements it is without them,
    which read none of their tables."""
    plain = plain_statements({"hotpath": lambda item: None})

    ran = []

    async def coroutine(item):
        ran.append(item.payload)
        await item.areport_progress(1, 2)

    handlers = {"hotpath": lambda item: None, "limited": lambda item: None, "coros": coroutine}
    settings.TXQUEUE = {
        "QUEUES": {
            "limited": {
                "RATE_LIMIT": "100/s",
                "RATE_LIMIT_PER_KEY": "10/s",
                "MAX_IN_FLIGHT": 3,
                "TIMEOUT": 5,
            },
            "coros": {"TIMEOUT": 2},
        }
    }
    # The features run first (their rows written), then the plain queue is drained by a
    # consumer that serves their queues too.
    Queue("limited").enqueue_many([{"n": n} for n in range(5)], key="k")
    group(step("limited", {"f": 1}), step("limited", {"f": 2}), then=step("coros", {})).enqueue()
    Queue("coros").enqueue_many([{"n": n} for n in range(3)])
    drain(handlers, batch=10)
    # A burst consumer may end before it claims the then its last acknowledgement released.
    drain(handlers, batch=10)
    limited = Queue("limited").items.filter(status=Status.DONE).count()
    assert (len(ran), limited) == (4, 7)  # the features ran
    featured = plain_statements(handlers)
    assert len(plain) >= 2  # its claims and acknowledgements, whichever form they take
    assert featured - plain == set() and plain - featured == set()
    text = " ".join(plain)
    for table in ("queuerate", "queueprogress", "queuedependency", "queuebound"):
        assert f"django_txqueue_{table}" not in text


class TestAckAndClaim:
    """The consumer acknowledges a batch with its next claim: in one statement on
    PostgreSQL, in one transaction on MySQL and MariaDB (skip_locked), one after the
    other on SQLite; the same outcome on each."""

    def test_acknowledges_the_held_claim_and_claims_the_next(self):
        queue = Queue("hotpath")
        queue.enqueue_many([{"n": n} for n in range(5)])
        first = queue.claim(2)
        results = {first[0].pk: {"sent": True}, first[1].pk: None}
        acknowledged, second = queue.claims.ack_and_claim(Ack(first[0].claim_token, results), 2)
        assert acknowledged == 2
        assert [item.payload["n"] for item in second] == [2, 3]
        assert {item.status for item in second} == {Status.IN_PROGRESS}
        rows = {row.pk: row for row in QueueItem.objects.filter(pk__in=results)}
        assert {row.status for row in rows.values()} == {Status.DONE}
        assert rows[first[0].pk].result == {"sent": True}
        assert rows[first[0].pk].finished_at is not None

    def test_a_stale_claim_is_refused_and_the_claim_still_runs(self):
        queue = Queue("hotpath")
        queue.enqueue_many([1, 2])
        (held,) = queue.claim(1)
        acknowledged, claimed = queue.claims.ack_and_claim(
            Ack(held.claim_token ^ 1, {held.pk: None}), 5
        )
        assert (acknowledged, len(claimed)) == (0, 1)
        assert QueueItem.objects.get(pk=held.pk).status == Status.IN_PROGRESS

    def test_with_nothing_left_to_claim_the_acknowledgement_still_counts(self):
        queue = Queue("hotpath")
        queue.enqueue(1)
        (held,) = queue.claim(1)
        assert queue.claims.ack_and_claim(Ack(held.claim_token, {held.pk: 7}), 10) == (1, [])
        assert QueueItem.objects.get(pk=held.pk).result == 7

    def test_each_acknowledgement_rides_with_the_next_claim(self):
        Queue("hotpath").enqueue_many([{"n": n} for n in range(30)])
        with CaptureQueriesContext(connection) as queries:
            worker = drain({"hotpath": lambda item: {"n": item.payload["n"]}}, batch=10)
        assert worker.processed == 30
        statements = [q["sql"] for q in queries.captured_queries]
        riding = [sql for sql in statements if sql.startswith("WITH acked AS")]
        alone = [sql for sql in statements if sql.startswith('UPDATE "django_txqueue_queueitem"')]
        acks = [n for n, sql in enumerate(statements) if re.search(r"finished_at.? = ", sql)]
        if not (has("acks_while_claiming") and has("skip_locked")):
            assert riding == []
        elif has("update_returning"):
            # In one statement: each batch's acknowledgement rides with the next claim, the
            # last one's too.
            assert (len(riding), len(alone)) == (3, 0)
        else:
            # Each opens the next claim's transaction: its locking read comes next. (More
            # than three when a conflict refused one, and store.retrying_conflicts ran the
            # transaction again, its acknowledgement with it: seen once under CI's load.)
            assert len(acks) >= 3
            assert all("SKIP LOCKED" in statements[n + 1] for n in acks)
        done = QueueItem.objects.filter(queue="hotpath", status=Status.DONE)
        assert sorted(row.result["n"] for row in done) == list(range(30))


@pytest.mark.skipif(connection.vendor != "postgresql", reason="psycopg's binding")
class TestPreparedStatements:
    """On PostgreSQL the claims and acknowledgements are prepared by the server when the
    connection's OPTIONS set ``prepare_threshold`` (Django's default binds them on the
    client, unprepared, as a transaction pool needs)."""

    def test_bound_on_the_client_by_default(self):
        Queue("hotpath").enqueue_many([{"n": n} for n in range(20)])
        with CaptureQueriesContext(connection) as queries:
            worker = drain({"hotpath": lambda item: None}, batch=10)
        assert worker.processed == 20
        claims = [q["sql"] for q in queries.captured_queries if "'hotpath'" in q["sql"]]
        assert claims and not any("$1" in sql for sql in claims)
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_prepared_statements")
            assert cursor.fetchone()[0] == 0

    def test_prepared_where_the_options_allow(self):
        Queue("hotpath").enqueue_many([{"n": n} for n in range(40)])
        options = connection.settings_dict["OPTIONS"]
        connection.close()
        options["prepare_threshold"] = 1  # prepared from the second execute on
        try:
            queue = Queue("hotpath")
            for _ in range(2):
                claimed = queue.claim(10)
                results = {item.pk: None for item in claimed}
                queue.claims.ack_and_claim(Ack(claimed[0].claim_token, results), 10)
            with connection.cursor() as cursor:
                cursor.execute("SELECT statement FROM pg_prepared_statements")
                prepared = [row[0] for row in cursor.fetchall()]
        finally:
            del options["prepare_threshold"]
            connection.close()
        assert any("SKIP LOCKED" in sql and "acked" in sql for sql in prepared), prepared
        assert any("SKIP LOCKED" in sql and "acked" not in sql for sql in prepared), prepared

    def test_enqueues_prepared_where_the_options_allow(self):
        # Enqueues bind as claims do: prepared too, not left to Django's client-side cursor.
        options = connection.settings_dict["OPTIONS"]
        connection.close()
        options["prepare_threshold"] = 1
        try:
            queue = Queue("hotpath")
            for n in range(3):
                queue.enqueue({"n": n})
            with connection.cursor() as cursor:
                cursor.execute("SELECT statement FROM pg_prepared_statements")
                prepared = [row[0] for row in cursor.fetchall()]
            # Every shape binds on the server: many rows (arrays), a delay, a dedup key.
            # (The dedup conflict's rollback makes psycopg deallocate what it prepared.)
            queue.enqueue_many([{"n": 3}, {"n": 4}])
            delayed = queue.enqueue({"n": 5}, delay=60)
            first = queue.enqueue({"n": 6}, dedup_key="d")
            assert queue.enqueue({"n": 7}, dedup_key="d").pk == first.pk
        finally:
            del options["prepare_threshold"]
            connection.close()
        assert any(sql.startswith('INSERT INTO "django_txqueue_queueitem"') for sql in prepared)
        rows = QueueItem.objects.order_by("pk")
        assert [item.payload["n"] for item in rows] == [0, 1, 2, 3, 4, 5, 6]
        delayed.refresh_from_db()
        assert delayed.run_at > delayed.created_at + datetime.timedelta(seconds=59)


@pytest.mark.skipif(connection.vendor != "postgresql", reason="psycopg's cursors")
class TestKeptCursor:
    """The claims, acknowledgements and inserts run on one psycopg cursor kept per
    connection (a new one per statement looks every adapter up again), through Django's
    wrapper all the same."""

    def test_one_cursor_per_connection_until_it_is_replaced(self):
        hot = dialect(connection).hot_cursor
        with hot(connection) as first, hot(connection) as second:
            assert first.cursor is second.cursor
            assert first.cursor.connection is connection.connection
        connection.close()
        Queue("hotpath").enqueue(1)  # on a new connection: a new cursor, not the closed one
        with hot(connection) as third:
            assert third.cursor is not first.cursor
            assert third.cursor.connection is connection.connection
        assert QueueItem.objects.get().payload == 1

    def test_a_connection_shared_between_threads_gets_a_cursor_per_statement(self):
        hot = dialect(connection).hot_cursor
        connection.inc_thread_sharing()
        try:
            with hot(connection) as first, hot(connection) as second:
                assert first.cursor is not second.cursor
        finally:
            connection.dec_thread_sharing()
        assert first.cursor.closed and second.cursor.closed

    def test_statements_still_reach_djangos_query_log_and_wrappers(self):
        seen = []

        def wrapper(execute, sql, params, many, context):
            seen.append(sql)
            return execute(sql, params, many, context)

        with CaptureQueriesContext(connection) as queries, connection.execute_wrapper(wrapper):
            Queue("hotpath").enqueue(1)
            Queue("hotpath").claim(1)
        assert seen[0].startswith('INSERT INTO "django_txqueue_queueitem"')
        assert any("SKIP LOCKED" in sql for sql in seen[1:])
        assert len(queries.captured_queries) == len(seen)

    def test_an_error_leaves_the_cursor_usable(self):
        hot = dialect(connection).hot_cursor
        # Django's error class: the kept cursor is still wrapped by Django.
        with (
            pytest.raises(DataError, match="division by zero"),
            transaction.atomic(),
            hot(connection) as cursor,
        ):
            Queue("hotpath").enqueue({"n": 1})
            cursor.execute("SELECT 1 / 0")
        Queue("hotpath").enqueue({"n": 2})
        with hot(connection) as again:
            assert again.cursor is cursor.cursor
        assert [item.payload for item in QueueItem.objects.all()] == [{"n": 2}]
