"""Claims: order, the claimed state, strategies, round trips, indexes, lock conflicts.

What happens to an item after its claim (ack, retry, fail, release, rescue, fencing,
lease renewal) is in test_store.py.
"""

import contextlib
import datetime as dt
import re
import threading
import time

import pytest
from django.db import NotSupportedError, connection, connections, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_txqueue import Queue, Status
from django_txqueue.db import dialect, dialect_for
from django_txqueue.db.compiler import ClaimStatement
from django_txqueue.models import Dashboard, QueueItem
from django_txqueue.store import Ack, consumer_identity
from tests.helpers import analyze, explain, has, item_reads, plan_lines, strategies
from tests.testapp.models import Thing


class TestOrder:
    def test_fifo(self, queue, strategy):
        items = queue.enqueue_many([{"n": n} for n in range(5)])
        claimed = queue.claim(3, strategy=strategy)
        assert [i.pk for i in claimed] == [i.pk for i in items[:3]]
        assert [i.pk for i in queue.claim(3, strategy=strategy)] == [i.pk for i in items[3:]]

    def test_priority_then_run_at_then_id(self, queue, strategy):
        now = timezone.now()
        late = queue.enqueue({"n": "late"}, run_at=now - dt.timedelta(seconds=1))
        early = queue.enqueue({"n": "early"}, run_at=now - dt.timedelta(seconds=9))
        urgent = queue.enqueue({"n": "urgent"}, priority=-1)
        lazy = queue.enqueue({"n": "lazy"}, priority=10, run_at=now - dt.timedelta(days=1))
        claimed = queue.claim(10, strategy=strategy)
        assert [i.pk for i in claimed] == [urgent.pk, early.pk, late.pk, lazy.pk]

    def test_items_not_yet_due_wait(self, queue, strategy):
        queue.enqueue({}, run_at=timezone.now() + dt.timedelta(minutes=5))
        due = queue.enqueue({})
        assert [i.pk for i in queue.claim(5, strategy=strategy)] == [due.pk]

    def test_lifo_through_a_queryset_order_by(self, db, strategy):
        things = Thing.objects.bulk_create([Thing(name=f"t{n}") for n in range(4)])
        claimed = Thing.objects.order_by("-pk").claim(2, strategy=strategy)
        assert [t.name for t in claimed] == ["t3", "t2"]
        assert [t.pk for t in Thing.objects.claim(5, strategy=strategy)] == [
            things[0].pk,
            things[1].pk,
        ]

    def test_queryset_filters_are_respected(self, db, strategy):
        Thing.objects.bulk_create([Thing(name=f"t{n}", group="ab"[n % 2]) for n in range(6)])
        claimed = Thing.objects.filter(group="b").claim(10, strategy=strategy)
        assert {t.name for t in claimed} == {"t1", "t3", "t5"}
        assert Thing.objects.ready().count() == 3

    def test_other_queues_are_untouched(self, db, strategy):
        Queue("a").enqueue({})
        Queue("b").enqueue({})
        assert [i.queue for i in Queue("a").claim(5, strategy=strategy)] == ["a"]
        assert Queue("b").count() == 1


class TestClaimedState:
    def test_claim_stamps_the_row(self, queue, strategy):
        queue.enqueue({"x": 1})
        [item] = queue.claim(1, strategy=strategy, pid="worker-1", lease=60)
        stored = QueueItem.objects.get(pk=item.pk)
        assert (stored.status, stored.pid, stored.attempts) == (Status.IN_PROGRESS, "worker-1", 1)
        assert stored.claim_token == item.claim_token is not None
        lease = stored.lease_expires_at - stored.claimed_at
        assert dt.timedelta(seconds=59) <= lease <= dt.timedelta(seconds=61)
        assert (item.status, item.pid, item.attempts, item.payload) == (
            Status.IN_PROGRESS,
            "worker-1",
            1,
            {"x": 1},
        )

    def test_default_pid_is_this_process_consumer_identity(self, queue, strategy):
        queue.enqueue({})
        [item] = queue.claim(strategy=strategy)
        assert item.pid == consumer_identity()
        host, os_pid, suffix = consumer_identity().rsplit(":", 2)
        assert os_pid.isdigit() and len(suffix) == 8

    def test_each_claim_gets_its_own_token(self, queue, strategy):
        queue.enqueue_many([{}, {}])
        [a] = queue.claim(1, strategy=strategy, pid="same")
        [b] = queue.claim(1, strategy=strategy, pid="same")
        assert a.claim_token != b.claim_token

    def test_empty_queue_claims_nothing(self, queue, strategy):
        assert queue.claim(10, strategy=strategy) == []

    def test_lease_as_timedelta_and_per_queue_default(self, db, strategy):
        Queue("short").enqueue({})
        [item] = Queue("short").claim(strategy=strategy)
        stored = QueueItem.objects.get(pk=item.pk)
        assert stored.lease_expires_at - stored.claimed_at <= dt.timedelta(seconds=1.5)

    def test_a_queryset_claim_gives_each_item_its_queues_lease(self, db, strategy):
        """The queue's LEASE wherever the claim starts: "short" has 1 s, others 300 s."""
        Queue("short").enqueue({})
        Queue("other").enqueue({})
        claimed = QueueItem.objects.filter(queue__in=["short", "other"]).claim(
            2, strategy=strategy
        )
        assert len(claimed) == 2
        leases = {
            item.queue: item.lease_expires_at - item.claimed_at
            for item in QueueItem.objects.filter(pk__in=[i.pk for i in claimed])
        }
        assert dt.timedelta(seconds=0.5) <= leases["short"] <= dt.timedelta(seconds=1.5)
        assert dt.timedelta(seconds=299) <= leases["other"] <= dt.timedelta(seconds=301)
        [again] = QueueItem.objects.filter(queue="short").claim(strategy=strategy) or [None]
        assert again is None  # both claimed above


class TestStrategies:
    def test_auto_picks_skip_locked_where_the_database_has_it(self, db):
        expected = "skip_locked" if "skip_locked" in strategies() else "update_limit"
        assert dialect(connection).resolve_strategy("auto", connection) == expected

    def test_claim_strategy_setting_steers_auto(self, db, settings):
        settings.TXQUEUE = {"CLAIM_STRATEGY": "update_limit"}
        assert dialect(connection).resolve_strategy("auto", connection) == "update_limit"

    @pytest.mark.lacks("skip_locked")
    def test_skip_locked_without_database_support_says_so(self, queue):
        queue.enqueue({})
        with pytest.raises(NotSupportedError, match="SKIP LOCKED.*update_limit"):
            queue.claim(1, strategy="skip_locked")
        assert queue.count() == 1

    @pytest.mark.parametrize("limit", [1, 3])
    def test_round_trips_per_claim(self, queue, strategy, limit):
        """docs/claims.md: a claim is one statement where RETURNING allows it."""
        queue.enqueue_many([{}] * 3)
        with CaptureQueriesContext(connection) as queries:
            assert len(queue.claim(limit, strategy=strategy)) == limit
        statements = [q["sql"] for q in queries.captured_queries if not _is_tx_control(q["sql"])]
        if has("update_returning"):
            expected = 1
        else:
            # UPDATE ... LIMIT, read back | SELECT ... SKIP LOCKED, UPDATE; of more than one
            # row, the SELECT locks by the READY index and a read by primary key follows.
            expected = 3 if strategy == "skip_locked" and limit > 1 else 2
        assert len(statements) == expected, statements


def _is_tx_control(sql):
    return (
        re.match(r"(?i)(SAVEPOINT|RELEASE|ROLLBACK|BEGIN|START TRANSACTION|COMMIT)", sql)
        is not None
    )


@pytest.mark.django_db(transaction=True)
class TestClaimPlans:
    """docs/claims.md: each claim must be one range scan of the READY index, with no sort.

    Otherwise InnoDB locks every candidate it examines and consumers run one at a time.
    The statements a real claim ran are EXPLAINed as they were run, on a table with a
    backlog of READY rows, more finished ones and a few in progress, after ANALYZE: the
    plan the database really picks, not one it was pushed to.
    """

    def fill(self, model, ready, finished):
        """``finished`` DONE rows, then ``ready`` READY ones; the queryset to claim from."""
        if model is QueueItem:
            queue = Queue("plans")
            for _ in range(finished // 1500):
                queue.enqueue_many([{}] * 1500)
            QueueItem.objects.update(status=Status.DONE)
            for _ in range(ready // 1500):
                queue.enqueue_many([{}] * 1500)
            return QueueItem.objects.filter(queue="plans")
        Thing.objects.bulk_create(
            [Thing(name="done", status=Status.DONE) for _ in range(finished)], batch_size=1500
        )
        Thing.objects.bulk_create([Thing(name="ready") for _ in range(ready)], batch_size=1500)
        return Thing.objects.all()

    def statements(self, claimer, strategy):
        """(sql, params) of each statement one claim of 5 ran, transaction control aside.

        ``claimer``: a queryset or a Queue."""
        ran = []

        def record(execute, sql, params, many, context):
            ran.append((sql, params))
            return execute(sql, params, many, context)

        with connection.execute_wrapper(record):
            assert len(claimer.claim(5, strategy=strategy)) == 5
        return [(sql, params) for sql, params in ran if not _is_tx_control(sql)]

    def assert_plan(self, plan, index):
        """No full scan and no sort; ``index``, if given, is what the statement reads."""
        text = "\n".join(str(row) for row in plan)
        lines = plan_lines(plan)
        if lines is None:  # MySQL's table of tables read, each with its access type
            plan = item_reads(plan)
            for row in plan:
                assert row["type"] in ("range", "ref", "eq_ref", "const"), text
                assert "filesort" not in row["Extra"] and "temporary" not in row["Extra"], text
            if index:
                assert plan[0]["key"] == index, text
            return
        for detail in lines:
            assert "Seq Scan" not in detail and "Sort" not in detail, text
            assert "TEMP B-TREE" not in detail, text
            # SQLite's SCAN is a full read, welcome only of the (partial) READY index.
            assert not detail.startswith("SCAN ") or (index and index in detail), text
        if index:
            assert index in text, text

    @pytest.mark.parametrize("model", [QueueItem, Thing], ids=["QueueItem", "QueueModel"])
    def test_each_claim_statement_reads_the_ready_index_in_order(self, strategy, model):
        queryset = self.fill(model, ready=3000, finished=6000)
        in_progress = list(queryset.ready().values_list("pk", flat=True)[:3])
        model.objects.filter(pk__in=in_progress).update(status=Status.IN_PROGRESS)
        analyze(model)
        statements = self.statements(queryset, strategy)
        [ready_index] = [
            i.name for i in model._meta.indexes if getattr(i, "status", None) == Status.READY
        ]
        # The first statement picks the rows; the rest (MySQL's UPDATE by pk, or the
        # read-back by claim token) must not scan either.
        for number, (sql, params) in enumerate(statements):
            plan = explain(sql, params)
            self.assert_plan(plan, ready_index if number == 0 else None)

    @pytest.mark.parametrize("name", ["fair", "ordered", "fair-ordered", "limited"])
    def test_fair_and_ordered_claims_read_the_ready_index_in_order(self, strategy, name):
        """An ordered claim adds two probes of the key index per candidate; a fair one
        reads the READY index by round: neither scans nor sorts."""
        queue = Queue(name)
        for n in range(4):
            queue.enqueue_many([{}] * 1500, key=f"done{n}")
        QueueItem.objects.update(status=Status.DONE)
        for n in range(100):
            queue.enqueue_many([{}] * 30, key=f"k{n}")
        running = list(queue.items.ready().values_list("pk", flat=True)[:3])
        QueueItem.objects.filter(pk__in=running).update(status=Status.IN_PROGRESS)
        analyze(QueueItem)
        for number, (sql, params) in enumerate(self.statements(queue, strategy)):
            self.assert_plan(explain(sql, params), "txqueue_item_ready" if number == 0 else None)

    def test_a_fair_enqueue_reads_its_round_through_indexes(self):
        queue = Queue("fair")
        for n in range(4):
            queue.enqueue_many([{}] * 1500, key=f"k{n}")
        finished = queue.claim(3000)
        QueueItem.objects.filter(pk__in=[item.pk for item in finished]).update(status=Status.DONE)
        analyze(QueueItem)
        ran = []

        def record(execute, sql, params, many, context):
            ran.append((sql, params))
            return execute(sql, params, many, context)

        with connection.execute_wrapper(record):
            queue.enqueue({}, key="k1")
        sql, params = ran[0]
        assert sql.startswith("SELECT")
        plan = explain(sql, params)
        text = "\n".join(str(row) for row in plan)
        lines = plan_lines(plan)
        if lines is None:  # MySQL's table of tables read
            # Only the key's newest few waiting rounds, a derived table, are read whole.
            assert all(
                row["type"] not in ("ALL", "index") or str(row["table"]).startswith("<derived")
                for row in plan
            ), text
            assert not any("filesort" in (row["Extra"] or "") for row in plan), text
        else:
            assert "Seq Scan" not in text and "Sort" not in text, text
            assert all(
                not line.startswith("SCAN ") or line == "SCAN CONSTANT ROW" for line in lines
            ), text


def test_the_ready_index_is_the_models_own():
    """What update_limit's index hint names on MySQL: a QueueModel subclass's own READY
    index, and for a proxy its concrete model's."""
    assert ClaimStatement(QueueItem.objects.all(), 1).ready_index == "txqueue_item_ready"
    assert ClaimStatement(Dashboard.objects.all(), 1).ready_index == "txqueue_item_ready"
    assert ClaimStatement(Thing.objects.all(), 1).ready_index == "testapp_thing_rdy"


@contextlib.contextmanager
def row_held_past_the_lock_wait_timeout(pk):
    """Another connection holds row ``pk`` (FOR UPDATE) for 1.6 s while this one waits at
    most 1 s for a lock (innodb_lock_wait_timeout): a first attempt times out (1205)."""
    holding = threading.Event()

    def hold_row():
        other = connections.create_connection("default")
        with other.cursor() as cursor:
            cursor.execute("START TRANSACTION")
            cursor.execute(
                f"SELECT id FROM {QueueItem._meta.db_table} WHERE id = %s FOR UPDATE", [pk]
            )
            holding.set()
            time.sleep(1.6)
            cursor.execute("COMMIT")
        other.close()

    holder = threading.Thread(target=hold_row)
    holder.start()
    try:
        assert holding.wait(5)
        with connection.cursor() as cursor:
            cursor.execute("SET SESSION innodb_lock_wait_timeout = 1")
        yield
    finally:
        holder.join(10)
        with connection.cursor() as cursor:
            cursor.execute("SET SESSION innodb_lock_wait_timeout = DEFAULT")


@pytest.mark.requires("innodb")  # its lock waits time out (innodb_lock_wait_timeout)
@pytest.mark.django_db(transaction=True)
def test_a_lock_wait_timeout_during_a_claim_is_retried_not_raised():
    """Another transaction holds the head row past innodb_lock_wait_timeout: the
    update_limit claim times out once (error 1205), retries, and then gets the row."""
    queue = Queue("locked")
    item = queue.enqueue({})
    with row_held_past_the_lock_wait_timeout(item.pk):
        started = time.monotonic()
        claimed = queue.claim(1, strategy="update_limit")
        assert [i.pk for i in claimed] == [item.pk]
        assert time.monotonic() - started >= 1.0  # it did wait, time out and retry


@pytest.mark.requires("innodb")
@pytest.mark.django_db(transaction=True)
def test_a_lock_wait_timeout_during_an_acknowledgement_is_retried_not_raised():
    """As for claims: a deadlock or lock-wait timeout fails only the fenced UPDATE, which
    is run again (InnoDB picks acknowledgements as deadlock victims against
    update_limit claims of ordered queues, whose subqueries lock what they read)."""
    [item] = Queue("locked-ack").enqueue_many([{}]) and Queue("locked-ack").claim(1)
    with row_held_past_the_lock_wait_timeout(item.pk):
        started = time.monotonic()
        assert item.ack()
        assert time.monotonic() - started >= 1.0  # it did wait, time out and retry
    assert QueueItem.objects.get(pk=item.pk).status == Status.DONE


@pytest.mark.requires("innodb", "acks_while_claiming", "skip_locked")
@pytest.mark.django_db(transaction=True)
def test_an_acknowledgement_timing_out_in_the_claims_transaction_is_retried_with_it():
    """On MySQL the acknowledgement rides in the skip_locked claim's transaction: when it
    times out, the whole transaction is rolled back and run again."""
    queue = Queue("locked-claim")
    queue.enqueue_many([{}, {}])
    [held] = queue.claim(1)
    with row_held_past_the_lock_wait_timeout(held.pk):
        acknowledged, claimed = queue.claims.ack_and_claim(
            Ack(held.claim_token, {held.pk: None}), 1
        )
    assert acknowledged == 1 and len(claimed) == 1 and claimed[0].pk != held.pk
    assert QueueItem.objects.get(pk=held.pk).status == Status.DONE


def open_transactions():
    """This connection's InnoDB transactions (MySQL and MariaDB alike)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT COUNT(*) FROM information_schema.innodb_trx "
            "WHERE trx_mysql_thread_id = CONNECTION_ID()"
        )
        return cursor.fetchone()[0]


# A skip_locked claim of several statements, in a transaction of its own (InnoDB's, whose
# open transactions information_schema.innodb_trx lists).
@pytest.mark.requires("innodb", "skip_locked")
@pytest.mark.lacks("update_returning")
@pytest.mark.django_db(transaction=True)
def test_a_claim_stopped_midway_leaves_no_transaction_open_and_its_rows_ready():
    """The skip_locked claim begins its transaction itself (START TRANSACTION, two round
    trips fewer than atomic()): stopped between its statements (a signal, a lost
    connection), it rolls back, so no lock or open transaction outlives it."""
    queue = Queue("stopped-claim")
    queue.enqueue_many([{}, {}])

    def stop_at_the_update(execute, sql, params, many, context):
        if sql.startswith("UPDATE"):
            raise KeyboardInterrupt
        return execute(sql, params, many, context)

    with connection.execute_wrapper(stop_at_the_update), pytest.raises(KeyboardInterrupt):
        queue.claim(2)
    assert open_transactions() == 0
    assert queue.items.filter(status=Status.READY).count() == 2
    other = connections.create_connection("default")
    try:  # not locked: another connection's SKIP LOCKED claim gets both
        with other.cursor() as cursor:
            table = QueueItem._meta.db_table
            cursor.execute(
                f"SELECT id FROM {table} WHERE queue = %s FOR UPDATE SKIP LOCKED", [queue.name]
            )
            assert len(cursor.fetchall()) == 2
    finally:
        other.close()


@pytest.mark.django_db(transaction=True)
class TestHeldRows:
    """Another transaction holds the first ready row (a competing ``dequeue()``, or a plain
    ``SELECT ... FOR UPDATE``) while this process claims."""

    pytestmark = pytest.mark.requires("skip_locked")

    @pytest.fixture(autouse=True)
    def long_lock_waits(self):
        """A claim that waits for a lock would wait well past the holder's transaction."""
        # The lock-wait setting of the databases with SKIP LOCKED: InnoDB's, or PostgreSQL's.
        if has("innodb"):
            statements = (
                "SET SESSION innodb_lock_wait_timeout = 20",
                "SET SESSION innodb_lock_wait_timeout = DEFAULT",
            )
        else:
            statements = ("SET lock_timeout = '20s'", "RESET lock_timeout")
        with connection.cursor() as cursor:
            cursor.execute(statements[0])
        yield
        with connection.cursor() as cursor:
            cursor.execute(statements[1])

    @contextlib.contextmanager
    def held(self, how, item, seconds):
        """Hold ``item``'s row in a transaction on another thread (and connection) until
        the block ends or ``seconds`` pass; yields the holder's record of what it did."""
        record = {}
        holding, release = threading.Event(), threading.Event()

        def hold():
            try:
                with transaction.atomic():
                    if how == "dequeue":
                        with Queue(item.queue).dequeue() as taken:
                            assert taken is not None
                            record["took"] = taken.pk
                            holding.set()
                            release.wait(seconds)
                    else:
                        QueueItem.objects.select_for_update().get(pk=item.pk)
                        record["took"] = item.pk
                        holding.set()
                        release.wait(seconds)
                    record["committing"] = time.monotonic()
            finally:
                connections.close_all()

        holder = threading.Thread(target=hold)
        holder.start()
        try:
            assert holding.wait(10), "the holder did not get the row"
            yield record
        finally:
            release.set()
            holder.join(30)
        assert not holder.is_alive()

    @pytest.mark.parametrize("how", ["dequeue", "select_for_update"])
    def test_a_skip_locked_claim_takes_the_next_row_at_once(self, how):
        queue = Queue("held")
        first, second, _ = queue.enqueue_many([{"n": n} for n in range(3)])
        with self.held(how, first, seconds=6) as holder:
            started = time.monotonic()
            claimed = queue.claim(1, strategy="skip_locked", pid="skipper")
            elapsed = time.monotonic() - started
            assert "committing" not in holder  # the row was still held when the claim returned
        assert holder["took"] == first.pk
        assert [i.pk for i in claimed] == [second.pk]
        assert elapsed < 1.0, f"the claim waited {elapsed:.1f} s for the held row"
        stored = QueueItem.objects.get(pk=second.pk)
        assert (stored.status, stored.pid) == (Status.IN_PROGRESS, "skipper")
        expected = Status.DONE if how == "dequeue" else Status.READY
        assert QueueItem.objects.get(pk=first.pk).status == expected

    @pytest.mark.parametrize(("how", "gets"), [("dequeue", 1), ("select_for_update", 0)])
    def test_an_update_limit_claim_waits_for_the_held_row(self, how, gets):
        """update_limit waits on the held row; once the holder commits, it takes that row if
        it is still READY, else reads on to the next one."""
        queue = Queue("held")
        items = queue.enqueue_many([{"n": n} for n in range(3)])
        hold = 1.5
        with self.held(how, items[0], seconds=hold) as holder:
            started = time.monotonic()
            claimed = queue.claim(1, strategy="update_limit", pid="waiter")
            finished = time.monotonic()
            assert "committing" in holder  # it returned only after the holder committed
        assert finished - started >= hold - 0.3
        assert finished >= holder["committing"]
        assert [i.pk for i in claimed] == [items[gets].pk]
        stored = QueueItem.objects.get(pk=items[gets].pk)
        assert (stored.status, stored.pid, stored.attempts) == (Status.IN_PROGRESS, "waiter", 1)


# A skip_locked claim in one UPDATE ... RETURNING, which finds the rows it locked again,
# on a table whose READY index is a partial one: PostgreSQL's (db/postgresql.py).
@pytest.mark.requires("update_returning", "skip_locked", "partial_indexes")
def test_the_claim_finds_its_rows_again_without_the_ready_index(db):
    """Statistics taken while the table was empty (autovacuum off, or not run yet) made
    the planner look each claimed id up in the READY partial index: a scan of all of it
    per row, which an old snapshot's dead entries made a crawl."""
    from django_txqueue.db.compiler import ClaimValues

    analyze(QueueItem)  # nothing in it
    queue = Queue("stale-statistics")
    queue.enqueue_many([{}] * 3000)
    statement = queue.claims.statement(10)
    values = ClaimValues("p", 1, dt.timedelta(seconds=300))
    sql, params = dialect_for(statement.alias)._claim_statement(
        statement, values, "FOR UPDATE SKIP LOCKED"
    )
    plan = plan_lines(explain(sql, params))
    # The candidates' scan reads the READY index; finding the picked rows again must not.
    assert sum("txqueue_item_ready" in line for line in plan) == 1, "\n".join(plan)
