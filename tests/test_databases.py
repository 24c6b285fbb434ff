"""Queues across databases: a queue's ``DATABASE`` or the router places its rows, and
everything that reads or writes them follows, the consumer serving several databases in
one loop. The second alias, "other", is on the same server here; tests/e2e/
test_two_servers.py puts it on another vendor's server."""

import functools
import io
import json
import subprocess
import sys
import time

import pytest
from django.core.management import call_command
from django.db import connections, transaction
from django.db.transaction import TransactionManagementError

from django_txqueue import Queue, Status, enqueue, on_commit
from django_txqueue.api import queue_databases
from django_txqueue.management import own_queue
from django_txqueue.models import Consumer, QueueItem
from django_txqueue.observe.reads import overview_of
from django_txqueue.tasks.backend import TASKS_FRAMEWORK
from tests.testapp.models import Run

from .helpers import FAST, ROOT, child_env, worker_for

BOTH = ["default", "other"]
ELSEWHERE = {"QUEUES": {"elsewhere": {"DATABASE": "other"}}}

pytestmark = pytest.mark.django_db(databases=BOTH, transaction=True)


class QueueRouter:
    """Places queue "routed" on "other" by the ``queue`` hint the queue API passes."""

    def db_for_write(self, model, **hints):
        return "other" if hints.get("queue") == "routed" else None

    db_for_read = db_for_write


@pytest.fixture
def elsewhere(settings):
    settings.TXQUEUE = {**settings.TXQUEUE, **FAST, **ELSEWHERE}


def rows(alias, queue):
    return list(
        QueueItem.objects.using(alias).filter(queue=queue).values_list("status", flat=True)
    )


class TestPlacement:
    def test_a_queues_database_setting_places_its_rows(self, elsewhere):
        item = enqueue("elsewhere", {"n": 1})
        assert (Queue("elsewhere").using, item._state.db) == ("other", "other")
        assert (rows("other", "elsewhere"), rows("default", "elsewhere")) == ([Status.READY], [])

    def test_the_router_places_a_queue_by_its_name(self, settings):
        settings.DATABASE_ROUTERS = [f"{__name__}.QueueRouter"]
        enqueue("routed", 1)
        enqueue("unrouted", 2)
        assert (rows("other", "routed"), rows("default", "unrouted")) == ([1], [1])
        assert (rows("default", "routed"), rows("other", "unrouted")) == ([], [])

    def test_the_settings_databases_are_listed_once(self, elsewhere):
        assert queue_databases() == ["default", "other"]


class TestTransactions:
    def test_enqueue_inside_another_databases_transaction_is_refused(self, elsewhere):
        with pytest.raises(TransactionManagementError) as caught, transaction.atomic():
            enqueue("elsewhere", 1)
        message = str(caught.value)
        assert "'other'" in message and "'default'" in message and "using='other'" in message
        assert rows("other", "elsewhere") == []

    def test_enqueue_many_is_refused_the_same_way(self, elsewhere):
        with pytest.raises(TransactionManagementError), transaction.atomic():
            Queue("elsewhere").enqueue_many([1, 2])
        assert rows("other", "elsewhere") == []

    def test_an_explicit_using_writes_at_once_on_its_own(self, elsewhere):
        with transaction.atomic():
            enqueue("elsewhere", 1, using="other")
            transaction.set_rollback(True)
        assert rows("other", "elsewhere") == [Status.READY]  # not rolled back with default's

    def test_in_its_own_databases_transaction_it_commits_and_rolls_back_with_it(self, elsewhere):
        with transaction.atomic(using="other"):
            enqueue("elsewhere", "kept")
        with transaction.atomic(using="other"):
            enqueue("elsewhere", "dropped")
            transaction.set_rollback(True, using="other")
        stored = QueueItem.objects.using("other").filter(queue="elsewhere")
        assert list(stored.values_list("payload", flat=True)) == ["kept"]

    def test_on_commit_refuses_a_transaction_on_another_database(self, settings):
        settings.TXQUEUE = {"QUEUES": {"django_txqueue.on_commit": {"DATABASE": "other"}}}
        with pytest.raises(TransactionManagementError, match="on_commit"), transaction.atomic():
            on_commit(print, "never")
        assert QueueItem.objects.using("other").count() == 0

    @pytest.mark.skipif(TASKS_FRAMEWORK is None, reason="no Django Tasks framework")
    def test_a_tasks_backend_on_another_database_is_refused_too(self, settings):
        settings.TASKS = {
            "default": {
                "BACKEND": "django_txqueue.backends.TxQueueBackend",
                "QUEUES": ["default", "tasks-other"],
                "OPTIONS": {"DATABASE": "other"},
            }
        }
        from tests.testapp.tasks import add

        with pytest.raises(TransactionManagementError, match="task"), transaction.atomic():
            add.enqueue(1, 2)
        result = add.enqueue(1, 2)  # outside a transaction: stored on "other"
        assert QueueItem.objects.using("other").filter(pk=result.id).exists()
        assert add.get_backend().get_result(result.id).id == result.id


class TestConsumer:
    def test_one_worker_drains_queues_on_both_databases(self, elsewhere):
        here = [enqueue("echo", n).pk for n in range(5)]
        there = [enqueue("elsewhere", n).pk for n in range(5)]
        placed = {"default": ["echo"], "other": ["elsewhere"]}
        worker = worker_for("echo", "elsewhere", using=placed, burst=True)
        assert worker.run() == 0
        assert rows("default", "echo") == [Status.DONE] * 5
        assert rows("other", "elsewhere") == [Status.DONE] * 5
        assert sorted(Run.objects.values_list("item_id", flat=True)) == here
        assert sorted(Run.objects.using("other").values_list("item_id", flat=True)) == there
        # One Consumer row per database, the same consumer, stopped, counting its own.
        for alias, count in (("default", 5), ("other", 5)):
            consumer = Consumer.objects.using(alias).get()
            assert (consumer.identity, consumer.processed) == (worker.identity, count)
            assert consumer.stopped_at is not None

    def test_run_queue_consumer_places_each_queue_where_it_lives(self, elsewhere, run_consumer):
        enqueue("echo", 1)
        enqueue("elsewhere", 2)
        run_consumer("echo", "elsewhere", burst=True)
        assert (rows("default", "echo"), rows("other", "elsewhere")) == (
            [Status.DONE],
            [Status.DONE],
        )

    def test_database_option_puts_every_queue_on_one(self, elsewhere, run_consumer):
        enqueue("elsewhere", 1, using="default")
        enqueue("elsewhere", 2)
        run_consumer("elsewhere", burst=True, database="default")
        assert (rows("default", "elsewhere"), rows("other", "elsewhere")) == (
            [Status.DONE],
            [Status.READY],
        )

    def test_a_queues_items_are_rescued_on_its_own_database(self, elsewhere):
        item = enqueue("elsewhere", 1)
        Queue("elsewhere").claim(pid="gone", lease=0.001)
        call_command("txqueue_requeue_stuck", stdout=io.StringIO())
        item.refresh_from_db(using="other")
        assert item.status == Status.READY

    @pytest.mark.slow  # starts a consumer process
    def test_a_consumer_process_is_woken_from_each_database(self, elsewhere, tmp_path):
        """A consumer of both databases, idle, hears of new items on each (LISTEN on
        PostgreSQL, a datagram elsewhere) long before its poll would find them: idle for
        IDLE seconds, its polls are 1.6 s and more apart (they double from 50 ms), so an
        item it finds within WOKEN of its commit was a wake-up."""
        env = {
            **child_env(),
            "TXQUEUE_TEST_SETTINGS": json.dumps({**FAST, **ELSEWHERE, "POLL_INTERVAL": 30}),
        }
        consumer = subprocess.Popen(
            [sys.executable, "-m", "django", "run_queue_consumer", "echo", "elsewhere"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        took = {}
        try:
            for queue, alias in (("echo", "default"), ("elsewhere", "other")):
                live = Consumer.objects.using(alias).filter(stopped_at=None)
                wait_for(live.exists)
                time.sleep(IDLE)
                with transaction.atomic(using=alias):
                    item = enqueue(queue, "wake", using=alias)
                committed = time.monotonic()
                wait_for(functools.partial(is_done, item), timeout=10)
                took[alias] = time.monotonic() - committed
        finally:
            consumer.terminate()
            _, err = consumer.communicate(timeout=30)
        assert consumer.returncode == 0, err.decode()[-2000:]
        assert all(seconds < WOKEN for seconds in took.values()), took


IDLE = 4.0  # seconds a consumer waits idle before the wake-up: its polls 1.6-3.2 s apart
WOKEN = 1.0  # at most this from commit to DONE: woken, not found by a poll


def is_done(item):
    return QueueItem.objects.using(item._state.db).get(pk=item.pk).status == Status.DONE


def wait_for(condition, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


class TestCommandsAndAdmin:
    def test_the_tools_own_queue_is_where_it_is_placed(self, elsewhere):
        """txqueue_bench and txqueue_chaos: --database, else where their queue lives."""
        assert own_queue("elsewhere", None) == ("other", "elsewhere")
        assert own_queue("elsewhere", "default") == ("default", "elsewhere")
        assert own_queue("plain", None) == ("default", "plain")

    def test_stats_without_names_shows_queues_on_every_database(self, elsewhere, capsys):
        enqueue("echo", 1)
        enqueue("elsewhere", 2)
        call_command("txqueue_stats", "--json")
        shown = {stat["queue"] for stat in json.loads(capsys.readouterr().out)}
        assert shown == {"echo", "elsewhere"}

    def test_the_dashboard_reads_every_database_and_names_it(self, elsewhere, admin_client):
        enqueue("echo", 1)
        enqueue("elsewhere", 2)
        overview = overview_of(queue_databases())
        assert {(row.name, row.database, row.ready) for row in overview.queues} == {
            ("echo", "default", 1),
            ("elsewhere", "other", 1),
        }
        page = admin_client.get("/admin/django_txqueue/dashboard/").content.decode()
        assert 'data-database="other"' in page and '<th scope="col">Database</th>' in page

    def test_one_database_shows_no_database_column(self, admin_client):
        enqueue("echo", 1)
        page = admin_client.get("/admin/django_txqueue/dashboard/").content.decode()
        assert "data-database" not in page


def test_connections_to_both_databases_are_distinct_databases():
    """Guards the test setup: "other" is a database of its own, not default again."""
    names = {connections[alias].settings_dict["NAME"] for alias in BOTH}
    assert len(names) == 2
