"""Enqueue's own INSERT (db/inserts.py): the rows it writes are the rows Model.save() and
bulk_create() would write, on every database, in one statement per shape."""

import datetime as dt

import pytest
from django.db import DatabaseError, IntegrityError, connection
from django.db.models.functions import Now
from django.db.models.signals import post_init
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_txqueue import Status, group, step
from django_txqueue.db.inserts import inserts
from django_txqueue.models import QueueItem
from tests.testapp.models import Thing

COLUMNS = ["queue", "payload", "priority", "key", "dedup_key", "max_attempts", "status"]


def stored(item):
    return QueueItem.objects.values(*COLUMNS).get(pk=item.pk)


def written(queue, payload, **changes):
    return {
        "queue": queue,
        "payload": payload,
        "priority": 0,
        "key": None,
        "dedup_key": None,
        "max_attempts": 5,
        "status": Status.READY,
        **changes,
    }


class TestOneItem:
    def test_one_insert_and_a_saved_item(self, queue):
        with CaptureQueriesContext(connection) as queries:
            item = queue.enqueue({"seat": 12}, key="tenant-a", priority=3)
        assert [q["sql"].split()[0] for q in queries.captured_queries] == ["INSERT"]
        assert (item._state.adding, item._state.db) == (False, "default")
        assert stored(item) == written(queue.name, {"seat": 12}, key="tenant-a", priority=3)

    def test_defaults_are_written_as_text_and_only_the_callers_values_are_bound(self, queue):
        sent = []  # each INSERT's text and parameters, as enqueue() sends them

        def capture(execute, sql, params, many, context):
            sent.append((sql, list(params or ())))
            return execute(sql, params, many, context)

        with connection.execute_wrapper(capture):
            plain = queue.enqueue({"seat": 1})
            given = queue.enqueue({"seat": 2}, priority=3, max_attempts=9)
        # The queue, the payload, and the values the caller gave: nothing else is bound.
        for (sql, params), bound in zip(sent, (2, 4), strict=True):
            assert len(params) == bound and params[0] == queue.name
            assert sql.count("%s") == bound
        assert stored(plain) == written(queue.name, {"seat": 1})
        assert stored(given) == written(queue.name, {"seat": 2}, priority=3, max_attempts=9)
        with CaptureQueriesContext(connection) as reads:  # what it wrote as text, it knows
            known = (plain.status, plain.attempts, plain.pid, plain.last_error)
        assert known == (Status.READY, 0, "", "") and reads.captured_queries == []

    def test_database_computed_values_load_on_first_access(self, queue):
        before = timezone.now() - dt.timedelta(seconds=5)
        item = queue.enqueue(None)
        row = QueueItem.objects.get(pk=item.pk)
        assert item.run_at == row.run_at and item.created_at == row.created_at
        assert item.run_at >= before
        assert item.active_dedup_key is None

    def test_null_payload_and_labels_are_written_as_null(self, queue):
        item = queue.enqueue(None, dedup_key="once")
        assert stored(item) == written(queue.name, None, dedup_key="once")
        assert QueueItem.objects.get(pk=item.pk).active_dedup_key == "once"

    def test_init_receivers_still_see_each_new_item(self, queue):
        seen = []

        def receiver(sender, instance, **kwargs):
            seen.append(instance)

        post_init.connect(receiver, sender=QueueItem)
        try:
            item = queue.enqueue({"n": 1})
        finally:
            post_init.disconnect(receiver, sender=QueueItem)
        assert seen == [item]


class TestManyItems:
    @pytest.mark.parametrize(
        "payloads",
        [[{"n": 0}, None, None, {"n": 3}, [4], None, "six"], [None, {"n": 1}, None, "three", 4]],
        ids=["first-given", "first-null"],
    )
    def test_mixed_payloads_keep_each_item_with_its_row(self, queue, payloads):
        # Rows are made from the first one, with their own payload; a first None payload
        # leaves its column out, and then each row is made whole.
        items = queue.enqueue_many(payloads)
        assert queue.count() == len(payloads)
        if connection.features.can_return_rows_from_bulk_insert:
            assert [stored(item)["payload"] for item in items] == payloads
            assert [item.pk for item in items] == sorted(item.pk for item in items)

    def test_delayed_items_are_due_later_by_the_database_clock(self, queue):
        items = queue.enqueue_many([1, 2, 3], delay=dt.timedelta(hours=1))
        assert queue.claim(5) == []
        for row in QueueItem.objects.filter(queue=queue.name):
            assert row.run_at - row.created_at >= dt.timedelta(minutes=59)
        assert len(items) == 3

    def test_more_rows_than_one_statement_takes(self, queue):
        writer = inserts(QueueItem, "default")
        shape, _ = writer.row(connection, queue.build({"n": 0}))
        count = writer.batch_size(shape) * 2 + 7
        queue.enqueue_many([{"n": n} for n in range(count)])
        assert sorted(p["n"] for p in queue.items.values_list("payload", flat=True)) == list(
            range(count)
        )

    @pytest.mark.requires("array_bulk_rows")  # PostgreSQL's unnest of arrays
    def test_postgresql_sends_the_payloads_as_one_json_array_and_shared_values_once(self, queue):
        with CaptureQueriesContext(connection) as queries:
            queue.enqueue_many([{"n": n} for n in range(500)], key="k")
        (insert,) = [q["sql"] for q in queries.captured_queries if q["sql"].startswith("INSERT")]
        assert "jsonb_array_elements(" in insert and "unnest(" not in insert
        assert insert.count("'k'") == 1  # the key, which every row has, sent once
        assert queue.items.filter(key="k").count() == 500

    @pytest.mark.requires("array_bulk_rows")
    def test_postgresql_sends_columns_that_vary_as_arrays(self, queue):
        """Payloads with an SQL NULL among them go as an array of jsonb: one JSON array
        would make the NULL JSON null."""
        payloads = [{"n": 0}, None, {"n": 2}]
        with CaptureQueriesContext(connection) as queries:
            queue.enqueue_many(payloads, key="k")
        (insert,) = [q["sql"] for q in queries.captured_queries if q["sql"].startswith("INSERT")]
        assert "unnest(" in insert and "jsonb[]" in insert
        rows = queue.items.filter(key="k").order_by("pk")
        assert [row.payload for row in rows] == payloads
        assert queue.items.filter(key="k", payload__isnull=True).count() == 1

    def test_many_rows_keep_their_text_times_and_order(self, queue):
        payloads = [{"text": "naïve café ☃ 🚀", "n": n, "quote": 'it\'s "x"'} for n in range(300)]
        run_at = timezone.now().replace(microsecond=123456) + dt.timedelta(minutes=5)
        items = queue.enqueue_many(payloads, key="clé ☃", run_at=run_at, priority=-3)
        rows = list(queue.items.order_by("pk").values("payload", "key", "run_at", "priority"))
        assert [row["payload"] for row in rows] == payloads
        assert {(row["key"], row["run_at"], row["priority"]) for row in rows} == {
            ("clé ☃", run_at, -3)
        }
        if connection.features.can_return_rows_from_bulk_insert:
            assert [item.pk for item in items] == [row.pk for row in queue.items.order_by("pk")]

    @pytest.mark.requires("json_bulk_rows")  # MySQL's and MariaDB's JSON_TABLE
    def test_mysql_sends_many_rows_as_one_json_parameter(self, queue):
        with CaptureQueriesContext(connection) as queries:
            queue.enqueue_many([{"n": n} for n in range(500)], key="k")
        (insert,) = [q["sql"] for q in queries.captured_queries if q["sql"].startswith("INSERT")]
        assert "JSON_TABLE(" in insert and ") VALUES (" not in insert
        assert queue.items.filter(key="k").count() == 500

    @pytest.mark.requires("json_bulk_rows")
    def test_a_flows_steps_and_edges_go_as_one_json_parameter_each(self, queue):
        """The flow's id is a UUID (MariaDB's native uuid column), sent as its text."""
        steps = [step(queue.name, {"n": n}) for n in range(200)]
        with CaptureQueriesContext(connection) as queries:
            flow = group(*steps, then=step(queue.name, {"then": True})).enqueue()
        inserts_sent = [
            q["sql"] for q in queries.captured_queries if q["sql"].startswith("INSERT")
        ]
        many = [sql for sql in inserts_sent if "JSON_TABLE(" in sql]
        assert len(many) == 2 and all(") VALUES (" not in sql for sql in many)  # steps, edges
        assert queue.items.filter(flow=flow.id).count() == 201

    @pytest.mark.requires("json_bulk_rows")
    def test_values_json_cannot_carry_go_as_values_rows(self):
        writer = inserts(Thing, "default")
        assert writer.bulk(connection, (("name", None),), [[b"\x00", b"\x01"]]) is None

    def test_all_or_none_across_statements(self, transactional_db):
        # Four statements (a claimed_at expression changes the shape); the last row fails.
        things = [Thing(name=f"t{n}", claimed_at=Now() if n % 2 else None) for n in range(4)] + [
            Thing(name=None)
        ]
        with pytest.raises(IntegrityError):
            inserts(Thing, "default").insert(things)
        assert Thing.objects.count() == 0

    @pytest.mark.requires("char_lengths")
    @pytest.mark.parametrize("shared", [False, True], ids=["one row's", "every row's"])
    def test_a_value_too_long_for_its_column_is_refused_not_cut(self, transactional_db, shared):
        """Also where every row has it, and it is sent once for all of them."""
        long = "x" * 60
        things = [Thing(name=long if shared else "short", group=f"g{n}") for n in range(3)]
        things.append(Thing(name=long, group="g3"))
        with pytest.raises(DatabaseError):
            inserts(Thing, "default").insert(things)
        assert not Thing.objects.filter(name__startswith="x").exists()

    def test_values_every_row_shares_are_written_to_every_row(self, queue):
        """A flow's id, a key, a time, a priority: each sent once where the database has
        a bulk source, and read back the same from every row."""
        run_at = timezone.now().replace(microsecond=654321) + dt.timedelta(minutes=3)
        flow = group(
            *(step(queue.name, {"n": n}, key="k é", run_at=run_at, priority=7) for n in range(50))
        ).enqueue()
        rows = queue.items.filter(flow=flow.id).order_by("pk")
        assert [row.payload for row in rows] == [{"n": n} for n in range(50)]
        assert {(r.key, r.run_at, r.priority, r.status) for r in rows} == {
            ("k é", run_at, 7, Status.READY)
        }
        assert [item.pk for item in flow.items] == [row.pk for row in rows]
        same = queue.enqueue_many([{"same": True}] * 20)  # every column shared
        assert queue.items.filter(payload={"same": True}).count() == len(same) == 20
