import datetime as dt
import decimal
import re
import uuid

import pytest
from django.core.serializers.json import DjangoJSONEncoder
from django.db import IntegrityError, connection, connections, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_txqueue import Queue, QueueFull, Status, enqueue, enqueue_many
from django_txqueue.models import QueueItem
from tests.helpers import analyze, has


def count_rows(queue_name, using_connection):
    with using_connection.cursor() as cursor:
        cursor.execute(
            f"SELECT COUNT(*) FROM {QueueItem._meta.db_table} WHERE queue = %s", [queue_name]
        )
        return cursor.fetchone()[0]


class TestEnqueue:
    def test_returns_a_saved_ready_item(self, queue):
        item = queue.enqueue({"to": "+15550100", "seat": 12}, priority=-3, key="tenant-a")
        stored = QueueItem.objects.get(pk=item.pk)
        assert stored.payload == {"to": "+15550100", "seat": 12}
        assert stored.status == Status.READY
        assert (stored.priority, stored.key, stored.attempts) == (-3, "tenant-a", 0)
        assert stored.max_attempts == 5
        assert item.run_at is not None and item.created_at is not None

    def test_module_function_is_the_same_as_the_method(self, db):
        item = enqueue("sms", {"n": 1}, max_attempts=2)
        assert (item.queue, item.max_attempts) == ("sms", 2)

    def test_payload_with_django_types(self, queue):
        when = timezone.now()
        item = queue.enqueue(
            {"at": when, "price": decimal.Decimal("1.50"), "id": uuid.UUID(int=7)}
        )
        stored = QueueItem.objects.get(pk=item.pk)
        assert stored.payload == {
            "at": DjangoJSONEncoder().default(when),
            "price": "1.50",
            "id": str(uuid.UUID(int=7)),
        }

    def test_per_queue_defaults_apply(self, db):
        assert Queue("short").enqueue(None).max_attempts == 2

    def test_delay_is_measured_on_the_database_clock(self, queue):
        item = queue.enqueue({}, delay=dt.timedelta(hours=1))
        assert item.run_at - item.created_at >= dt.timedelta(minutes=59)
        assert queue.claim(1) == []
        assert queue.count() == 1

    def test_run_at_in_the_past_is_due(self, queue):
        queue.enqueue({}, run_at=timezone.now() - dt.timedelta(days=1))
        assert len(queue.claim(5)) == 1

    def test_enqueue_many_is_one_insert(self, queue):
        with CaptureQueriesContext(connection) as queries:
            items = queue.enqueue_many([{"n": n} for n in range(50)], priority=2)
        inserts = [q for q in queries.captured_queries if q["sql"].startswith("INSERT")]
        assert len(inserts) == 1
        assert queue.count() == 50
        assert {item.priority for item in items} == {2}
        if connection.features.can_return_rows_from_bulk_insert:
            assert sorted(i.pk for i in items) == sorted(queue.items.values_list("pk", flat=True))

    def test_enqueue_many_module_function(self, db):
        assert len(enqueue_many("bulk", [1, 2, 3], delay=5)) == 3
        assert Queue("bulk").count() == 3

    def test_enqueue_many_nothing(self, queue):
        assert queue.enqueue_many([]) == []


class TestValidation:
    """Bad input raises the error docs/producing.md names, before any query."""

    @pytest.mark.parametrize(
        ("call", "error", "message"),
        [
            (lambda: enqueue("q", {"f": object()}), TypeError, "object"),
            (lambda: enqueue("q", {1, 2}), TypeError, "set"),
            (lambda: enqueue("", {}), ValueError, "1 to 100"),
            (lambda: enqueue("x" * 101, {}), ValueError, "1 to 100"),
            (lambda: enqueue("q", {}, run_at=dt.datetime(2030, 1, 1)), ValueError, "naive"),
            (lambda: enqueue("q", {}, priority="1"), ValueError, "priority"),
            (lambda: enqueue("q", {}, priority=1.5), ValueError, "priority"),
            (lambda: enqueue("q", {}, priority=True), ValueError, "priority"),
            (lambda: enqueue("q", {}, priority=2**40), ValueError, "priority"),
            (lambda: enqueue("q", {}, delay=-1), ValueError, "delay"),
            (lambda: enqueue("q", {}, delay="soon"), TypeError, "delay"),
            (lambda: enqueue("q", {}, delay=1, run_at=timezone.now()), ValueError, "not both"),
            (lambda: enqueue("q", {}, max_attempts=0), ValueError, "max_attempts"),
            (lambda: enqueue("q", {}, key=""), ValueError, "key"),
            (lambda: enqueue("q", {}, dedup_key=5), TypeError, "dedup_key"),
            (lambda: enqueue_many("q", [{}, object()]), TypeError, "object"),
            (lambda: enqueue_many("q", [{}], dedup_key="k"), ValueError, "dedup_key"),
            (lambda: Queue("q").claim(1, strategy="fastest"), ValueError, "fastest"),
            (lambda: Queue("q").claim(0), ValueError, "limit"),
            (lambda: Queue("q").claim(1, lease="long"), TypeError, "lease"),
        ],
    )
    def test_bad_input_is_rejected_and_nothing_is_written(self, db, call, error, message):
        with CaptureQueriesContext(connection) as queries, pytest.raises(error, match=message):
            call()
        assert queries.captured_queries == []
        assert QueueItem.objects.count() == 0


@pytest.mark.django_db(transaction=True)
class TestTransactions:
    def test_invisible_to_another_connection_until_commit(self):
        other = connections.create_connection("default")
        try:
            with transaction.atomic():
                enqueue("tx", {"seat": 1})
                assert count_rows("tx", connection) == 1
                assert count_rows("tx", other) == 0
            assert count_rows("tx", other) == 1
        finally:
            other.close()

    def test_gone_on_rollback(self):
        with pytest.raises(RuntimeError), transaction.atomic():
            enqueue("tx", {"seat": 1})
            raise RuntimeError("booking failed")
        assert Queue("tx").count(status=None) == 0

    def test_dequeue_takes_an_item_and_finishes_it_in_the_same_transaction(self):
        queue = Queue("dq")
        first, second = queue.enqueue_many([{"n": 1}, {"n": 2}])
        with queue.dequeue() as item:
            assert item.pk == first.pk
            assert item.status == Status.IN_PROGRESS
        assert QueueItem.objects.get(pk=first.pk).status == Status.DONE
        assert QueueItem.objects.get(pk=second.pk).status == Status.READY

    def test_dequeue_exception_puts_the_item_back_at_once(self):
        queue = Queue("dq")
        queue.enqueue({"n": 1})
        with pytest.raises(ValueError), queue.dequeue() as item:
            raise ValueError("handler broke")
        back = QueueItem.objects.get(pk=item.pk)
        assert (back.status, back.attempts) == (Status.READY, 0)
        assert [i.pk for i in queue.claim(1)] == [item.pk]

    def test_dequeue_yields_none_when_empty(self):
        with Queue("dq").dequeue() as item:
            assert item is None

    def test_dequeue_nested_in_a_transaction_uses_a_savepoint(self):
        queue = Queue("dq")
        queue.enqueue({})
        with transaction.atomic():
            with pytest.raises(KeyError), queue.dequeue():
                raise KeyError
            assert queue.count() == 1


class TestDedup:
    def test_unfinished_twin_is_returned_and_nothing_written(self, queue):
        first = queue.enqueue({"v": 1}, dedup_key="order-7")
        again = queue.enqueue({"v": 2}, dedup_key="order-7")
        assert again.pk == first.pk
        assert again.payload == {"v": 1}
        assert queue.count(status=None) == 1

    def test_in_progress_twin_still_deduplicates(self, queue):
        first = queue.enqueue({}, dedup_key="k")
        queue.claim(1)
        assert queue.enqueue({}, dedup_key="k").pk == first.pk

    def test_finished_twin_allows_a_new_item(self, queue):
        first = queue.enqueue({}, dedup_key="k")
        [claimed] = queue.claim(1)
        assert claimed.ack()
        second = queue.enqueue({}, dedup_key="k")
        assert second.pk != first.pk
        assert queue.count(status=None) == 2

    def test_same_key_on_another_queue_is_independent(self, db):
        assert enqueue("a", {}, dedup_key="k").pk != enqueue("b", {}, dedup_key="k").pk

    def test_database_constraint_holds_against_a_raw_insert(self, queue):
        queue.enqueue({}, dedup_key="k")
        twin = queue.build({}, dedup_key="k")
        with pytest.raises(IntegrityError), transaction.atomic():
            twin.save(force_insert=True)

    def test_dedup_inside_a_transaction_keeps_it_usable(self, queue):
        with transaction.atomic():
            first = queue.enqueue({}, dedup_key="k")
            assert queue.enqueue({}, dedup_key="k").pk == first.pk
            queue.enqueue({})
        assert queue.count() == 2


class TestBounded:
    def test_queue_full_carries_item_and_size_and_writes_nothing(self, db):
        bounded = Queue("bounded")
        bounded.enqueue_many([1, 2, 3])
        with pytest.raises(QueueFull) as caught:
            bounded.enqueue({"n": 4})
        assert caught.value.current_size == 3
        assert caught.value.item.payload == {"n": 4} and caught.value.item.pk is None
        assert bounded.count() == 3

    def test_only_unfinished_items_count_towards_max_size(self, db):
        bounded = Queue("bounded")  # MAX_SIZE 3 in tests/settings.py
        bounded.enqueue_many([{"n": 1}, {"n": 2}, {"n": 3}])
        done, failed, running = bounded.claim(3)
        assert done.ack() and failed.fail("gave up")
        # One IN_PROGRESS item is left: two more fit, finished items do not count.
        bounded.enqueue({"n": 4})
        bounded.enqueue_many([{"n": 5}])
        with pytest.raises(QueueFull) as caught:
            bounded.enqueue({"n": 6})
        assert caught.value.current_size == 3  # IN_PROGRESS and READY; not DONE or FAILED
        assert caught.value.item.payload == {"n": 6} and caught.value.item.pk is None
        assert bounded.count(status=None) == 5
        # A batch that would not fit is refused whole; its first item is the one carried.
        assert running.ack()
        with pytest.raises(QueueFull) as caught:
            bounded.enqueue_many([{"n": 7}, {"n": 8}])
        assert caught.value.current_size == 2
        assert caught.value.item.payload == {"n": 7} and caught.value.item.pk is None
        assert bounded.count(status=None) == 5
        assert [i.payload for i in bounded.enqueue_many([{"n": 7}])] == [{"n": 7}]
        assert sorted(bounded.items.values_list("status", flat=True)) == [
            Status.READY,
            Status.READY,
            Status.READY,
            Status.DONE,
            Status.DONE,
            Status.FAILED,
        ]


class TestInspect:
    def test_peek_returns_the_next_claim_unchanged(self, queue):
        queue.enqueue({"n": 1}, priority=5)
        urgent = queue.enqueue({"n": 2}, priority=-5)
        assert queue.peek().pk == urgent.pk
        assert QueueItem.objects.get(pk=urgent.pk).status == Status.READY
        assert queue.claim(1)[0].pk == urgent.pk

    def test_peek_empty(self, queue):
        assert queue.peek() is None

    def test_count_by_status(self, queue):
        queue.enqueue_many([{}] * 4)
        [done, failed] = queue.claim(2)
        done.ack()
        failed.fail("boom")
        assert queue.count() == 2
        assert queue.count(status=Status.DONE) == 1
        assert queue.count(status=Status.FAILED) == 1
        assert queue.count(status=None) == 4

    def test_stats(self, queue):
        queue.enqueue_many([{}] * 3, run_at=timezone.now() - dt.timedelta(seconds=30))
        queue.claim(1)[0].ack()
        queue.claim(1, lease=0)
        stats = queue.stats()
        assert {k: stats[k] for k in ("ready", "in_progress", "done", "failed", "stuck")} == {
            "ready": 1,
            "in_progress": 1,
            "done": 1,
            "failed": 0,
            "stuck": 1,
        }
        assert 29 <= stats["oldest_ready_age_s"] < 120

    def test_stats_counts_done_items_only_up_to_a_bound(self, queue, monkeypatch):
        monkeypatch.setattr("django_txqueue.observe.reads.EXACT_DONE_UP_TO", 2)
        queue.enqueue_many([{}] * 5)
        for item in queue.claim(5):
            item.ack()
        with CaptureQueriesContext(connection) as queries:
            done = queue.stats()["done"]
        # Past the bound the planner's estimate stands, never below the 3 rows counted;
        # a database without statistics (SQLite) counts them all.
        assert done >= 3 if has("statistics") else done == 5
        assert any("LIMIT 3" in q["sql"] for q in queries.captured_queries)

    def test_stats_of_an_empty_queue(self, queue):
        assert queue.stats()["oldest_ready_age_s"] == 0.0

    def test_approximate_count_runs_no_count_query(self, queue):
        queue.enqueue_many([{}] * 40)
        for item in queue.claim(10):
            item.ack()
        Queue(f"{queue.name}-other").enqueue_many([{}] * 100)  # READY, but not this queue's
        if has("statistics") and has("transactional_ddl"):
            # Fresh statistics for the planner. InnoDB's index dives need none (and its
            # ANALYZE TABLE would commit the test's transaction).
            analyze(QueueItem)
        with CaptureQueriesContext(connection) as queries:
            estimate = queue.approximate_count()
        assert isinstance(estimate, int)
        if not has("statistics"):
            assert estimate == 30  # the exact count, through the READY index
        else:
            # 30 READY rows: an estimate, but of this queue's READY rows, not the table's.
            assert 15 <= estimate <= 60, estimate
            assert all("EXPLAIN" in q["sql"] for q in queries.captured_queries)


class TestMaintenance:
    def test_purge_deletes_only_old_finished_items_in_batches(self, queue, monkeypatch):
        monkeypatch.setattr("django_txqueue.store.upkeep.PURGE_BATCH", 3)
        queue.enqueue_many([{}] * 10)
        for item in queue.claim(7):
            item.ack() if item.pk % 2 else item.fail("x")
        assert queue.purge(older_than=dt.timedelta(days=1)) == 0
        assert queue.purge(older_than=0) == 7
        assert queue.count(status=None) == 3

    def test_purge_deletes_in_short_batches_of_purge_batch(self, queue, monkeypatch):
        monkeypatch.setattr("django_txqueue.store.upkeep.PURGE_BATCH", 3)
        queue.enqueue_many([{"n": n} for n in range(12)])
        claimed = queue.claim(11)
        for item in claimed[:10]:
            assert item.ack() if item.payload["n"] % 2 else item.fail("x")
        old, recent = claimed[:8], claimed[8:10]
        in_progress = claimed[10]
        [ready] = queue.items.filter(status=Status.READY)
        other = Queue(f"{queue.name}-other").enqueue({})
        Queue(other.queue).claim(1)[0].ack()
        two_days_ago = timezone.now() - dt.timedelta(days=2)
        QueueItem.objects.filter(pk__in=[i.pk for i in old] + [other.pk]).update(
            finished_at=two_days_ago
        )

        with CaptureQueriesContext(connection) as queries:
            assert queue.purge(older_than=dt.timedelta(days=1)) == 8
        deletes = [q["sql"] for q in queries.captured_queries if q["sql"].startswith("DELETE")]
        id_lists = [re.search(r"\bid\W* IN \(([\d, ]+)\)", sql) for sql in deletes]
        assert all(id_lists), deletes
        batches = [{int(pk) for pk in ids.group(1).split(",")} for ids in id_lists if ids]
        assert [len(batch) for batch in batches] == [3, 3, 2], deletes
        assert set().union(*batches) == {i.pk for i in old}

        survivors = {i.pk for i in (*recent, in_progress, ready)}
        assert set(queue.items.values_list("pk", flat=True)) == survivors
        assert QueueItem.objects.filter(pk=other.pk).exists()
        assert queue.purge(older_than=0) == 2
        assert set(queue.items.values_list("status", flat=True)) == {
            Status.READY,
            Status.IN_PROGRESS,
        }

    def test_purge_leaves_other_queues_alone(self, db):
        for name in ("a", "b"):
            Queue(name).enqueue({})
            Queue(name).claim(1)[0].ack()
        assert Queue("a").purge() == 1
        assert Queue("b").count(status=Status.DONE) == 1


def test_public_api_is_importable_from_the_package():
    import django_txqueue
    from django_txqueue.consumer import registry

    assert django_txqueue.handler is registry.handler
    assert set(django_txqueue.__all__) >= {
        "Queue",
        "QueueFull",
        "Status",
        "enqueue",
        "enqueue_many",
        "handler",
    }
    with pytest.raises(AttributeError):
        django_txqueue.nothing_here  # noqa: B018


def test_every_public_name_imports_from_the_package():
    """Each name of the public API, ``QueueItem`` included, by ``from django_txqueue import``."""
    import django_txqueue
    from django_txqueue import QueueFull as Full
    from django_txqueue import QueueItem as Item
    from django_txqueue import Status as State
    from django_txqueue import exceptions, models

    assert Item is models.QueueItem
    assert State is models.Status
    assert Full is exceptions.QueueFull
    assert {"QueueItem", "QueueModel", "Consumer"} <= set(django_txqueue.__all__)
    for name in django_txqueue.__all__:
        assert getattr(django_txqueue, name) is not None
