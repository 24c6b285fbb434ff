"""db/base.py: what every vendor's Dialect shares; the vendors' claims are in
test_claim.py, their inserts in test_inserts.py."""

import pytest
from django.db import Error, connection, transaction
from django.test.utils import CaptureQueriesContext

from django_txqueue import Queue, Status, store
from django_txqueue.consumer.execution import drop_connection
from django_txqueue.db import dialect_for
from django_txqueue.models import QueueItem
from tests.helpers import has, lose_connection, wait_for


def estimated_count(queryset, bound):
    return dialect_for(queryset.db).estimated_count(queryset, bound)


class TestEstimatedCount:
    def test_exact_up_to_its_bound_reading_no_more_rows_than_that(self, db):
        Queue("a").enqueue_many([{}] * 30)
        with CaptureQueriesContext(connection) as queries:
            assert estimated_count(QueueItem.objects.filter(queue="a"), 30) == 30
        [count] = [q["sql"] for q in queries.captured_queries]
        assert "LIMIT 31" in count.upper() and "EXPLAIN" not in count.upper()

    def test_past_its_bound_an_estimate_never_below_the_rows_counted(self, db):
        Queue("a").enqueue_many([{}] * 30)
        Queue("b").enqueue_many([{}] * 5)
        with CaptureQueriesContext(connection) as queries:
            counted = estimated_count(QueueItem.objects.filter(queue="a"), 10)
        statements = [q["sql"].upper() for q in queries.captured_queries]
        assert "LIMIT 11" in statements[0]
        if has("statistics"):
            assert counted >= 11
            assert len(statements) == 2 and statements[1].startswith("EXPLAIN")
        else:  # exact again: no statistics to estimate from
            assert counted == 30
            assert len(statements) == 2 and "LIMIT" not in statements[1]

    @pytest.mark.parametrize("bound", [0, 5])
    def test_an_empty_queryset_is_zero(self, db, bound):
        assert estimated_count(QueueItem.objects.filter(queue="none"), bound) == 0


def broken_query():
    """A query on this thread's connection after the server dropped it; the error it
    raised."""
    lose_connection()
    try:
        QueueItem.objects.count()
    except Error as exc:
        return exc
    finally:
        drop_connection("default")
    raise AssertionError("a closed connection answered")


@pytest.mark.django_db(transaction=True)
class TestIsDisconnect:
    """``is_disconnect``: the connection is lost (drop it, reconnect); the database's
    failure, never the handler's."""

    @pytest.mark.requires("lost_connections")
    def test_a_lost_connection_is_one(self):
        assert dialect_for("default").is_disconnect(broken_query())
        assert QueueItem.objects.count() == 0  # reconnected

    def test_a_statements_own_error_is_not(self):
        with pytest.raises(Error) as raised, connection.cursor() as cursor:
            cursor.execute("SELECT no_such_column FROM django_txqueue_queueitem")
        assert not dialect_for("default").is_disconnect(raised.value)

    @pytest.mark.requires("read_only_standbys")
    def test_a_write_refused_as_read_only_is_one(self):
        """What a connection left on a former primary, now a standby, meets."""
        with pytest.raises(Error) as raised, transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SET TRANSACTION READ ONLY")
            Queue("read-only").enqueue({})
        assert dialect_for("default").is_disconnect(raised.value)


@pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's key arrays")
@pytest.mark.django_db
def test_integer_keys_go_as_one_array_text_others_as_a_list():
    """Integer keys are sent as an array's text (psycopg dumps a list value by value);
    the server reads either as the key column's array type."""
    postgresql = dialect_for("default")
    assert postgresql.pk_params([3, 2**40]) == ["{3,1099511627776}"]
    assert postgresql.pk_params(["a,b", "c"]) == [["a,b", "c"]]  # no quoting of our own
    items = Queue("keys").enqueue_many([1, 2, 3])
    with connection.cursor() as cursor:
        for params in (postgresql.pk_params([i.pk for i in items]), [[i.pk for i in items]]):
            cursor.execute(
                f"SELECT count(*) FROM {QueueItem._meta.db_table} WHERE id = ANY(%s)", params
            )
            assert cursor.fetchone()[0] == 3


@pytest.mark.skipif(connection.vendor != "mysql", reason="InnoDB's purge")
@pytest.mark.django_db(transaction=True)
def test_innodb_purge_is_seen_done_once_nothing_is_left_to_purge():
    # What txqueue_bench waits for after emptying its table: the delete-marked rows gone.
    # Nothing runs after the delete here, so the purge's own mark stays below it.
    Queue("purge").enqueue_many([{"n": n} for n in range(50)])
    QueueItem.objects.filter(queue="purge").delete()
    deleted_before = dialect_for("default").purge_progress(connection)[0]

    def purged():
        counter, done = dialect_for("default").purge_progress(connection)
        return done >= deleted_before

    assert wait_for(purged, timeout=30), dialect_for("default").purge_progress(connection)


def test_an_empty_history_list_is_a_purge_done_up_to_the_counter():
    from django_txqueue.db.mysql import purge_status

    # As a MariaDB 10.11 showed it, idle after the bench emptied its table: the purge's
    # mark one below the counter for good, with nothing left to purge.
    idle = (
        "Trx id counter 31530\n"
        "Purge done for trx's n:o < 31529 undo n:o < 0 state: running but idle\n"
        "History list length 0\n"
    )
    assert purge_status(idle) == (31530, 31530)
    busy = idle.replace("History list length 0", "History list length 12")
    assert purge_status(busy) == (31530, 31529)
    assert purge_status("no InnoDB here") is None


def test_a_look_finds_the_queues_with_due_ready_items(db):
    Queue("due").enqueue({})
    Queue("later").enqueue({}, delay=3600)
    Queue("it's").enqueue_many([{}] * 3)
    Queue("done").enqueue({})
    QueueItem.objects.filter(queue="done").update(status=Status.DONE)
    names = ["due", "later", "it's", "done", "empty"]
    assert store.queues_with_due_items(QueueItem, "default", names) == {"due", "it's"}
    assert store.queues_with_due_items(QueueItem, "default", []) == set()


@pytest.mark.skipif(connection.vendor != "mysql", reason="MariaDB's semi-joins")
def test_on_mariadb_a_look_probes_each_queue_rather_than_reading_every_ready_row(db):
    Queue("busy").enqueue_many([{}] * 200)
    with CaptureQueriesContext(connection) as queries:
        store.queues_with_due_items(QueueItem, "default", ["busy", "idle"])
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN {queries.captured_queries[-1]['sql']}")
        kinds = {row[1] for row in cursor.fetchall()}
    assert "DEPENDENT SUBQUERY" in kinds and "MATERIALIZED" not in kinds, kinds
