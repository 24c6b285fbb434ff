"""The consumer loop in this process (threads, real database); e2e/ runs it as a command."""

import logging
import time

import pytest
from django.db import OperationalError, connections
from django.db.backends.signals import connection_created

from django_txqueue import Queue, Status, signals, store
from django_txqueue.consumer.wakeup import ADDRESS_CACHE_SECONDS
from django_txqueue.consumer.worker import Progress
from django_txqueue.models import Consumer, QueueItem
from tests.helpers import running, runs_per_item, wait_for, worker_for
from tests.testapp.models import Run

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fast_consumers")]


class TestBurst:
    @pytest.mark.parametrize(("concurrency", "batch"), [(1, None), (1, 10), (4, None), (3, 7)])
    def test_processes_everything_once_and_stores_results(self, concurrency, batch):
        items = Queue("echo").enqueue_many([{"n": n} for n in range(40)])
        assert worker_for("echo", concurrency=concurrency, batch=batch, burst=True).run() == 0
        ids = set(Queue("echo").items.values_list("pk", flat=True))
        assert Queue("echo").count(status=Status.DONE) == 40
        assert runs_per_item() == dict.fromkeys(ids, 1)
        stored = QueueItem.objects.get(pk=items[3].pk if items[3].pk else min(ids) + 3)
        assert stored.result == stored.payload
        assert stored.attempts == 1 and stored.finished_at is not None

    def test_burst_does_not_wait_for_items_scheduled_later(self):
        Queue("echo").enqueue({}, delay=60)
        started = time.monotonic()
        assert worker_for("echo", burst=True).run() == 0
        assert time.monotonic() - started < 5
        assert Queue("echo").count() == 1

    def test_debug_query_logs_do_not_grow(self, settings):
        """DEBUG=True logs every query of a connection until a request starts: a
        consumer's threads empty their logs as they go, else they hold thousands."""
        settings.DEBUG = True
        opened = [connections["default"]]

        def record(sender, connection, **kwargs):
            opened.append(connection)

        connection_created.connect(record)
        try:
            Queue("echo").enqueue_many([{}] * 60)
            assert worker_for("echo", batch=1, burst=True).run() == 0
        finally:
            connection_created.disconnect(record)
        assert Queue("echo").count(status=Status.DONE) == 60
        assert len(opened) > 1 and max(len(c.queries_log) for c in opened) < 20

    def test_consumer_row_registered_and_stopped(self):
        Queue("echo").enqueue_many([{}] * 3)
        worker = worker_for("echo", burst=True)
        worker.run()
        consumer = Consumer.objects.get(identity=worker.identity)
        assert consumer.queues == ["echo", "django_txqueue.on_commit"]
        assert consumer.stopped_at is not None and consumer.processed == 3
        assert set(QueueItem.objects.values_list("pid", flat=True)) == {worker.identity}

    def test_final_counts_on_the_consumer_row_survive_a_late_heartbeat(self, settings):
        """A heartbeat's UPDATE can reach the server late (a GIL stall, a slow network):
        the stopped consumer's row must still show everything it processed."""
        settings.TXQUEUE = {**settings.TXQUEUE, "HEARTBEAT_INTERVAL": 0.1}

        def late_heartbeat(execute, sql, params, many, context):
            if sql.startswith("UPDATE") and "last_heartbeat_at" in sql:
                time.sleep(1.0)
            return execute(sql, params, many, context)

        def instrument(sender, connection, **kwargs):
            connection.execute_wrappers.append(late_heartbeat)

        Queue("slow").enqueue_many([{"seconds": 0.05}] * 6)
        worker = worker_for("slow", burst=True)
        connection_created.connect(instrument)
        try:
            assert worker.run() == 0
        finally:
            connection_created.disconnect(instrument)
        assert (worker.processed, Queue("slow").count(status=Status.DONE)) == (6, 6)
        consumer = Consumer.objects.get(identity=worker.identity)
        assert consumer.stopped_at is not None
        assert consumer.processed == 6


class TestFailures:
    def test_raising_handler_retries_then_fails_with_traceback(self):
        item = Queue("boom").enqueue({"x": 1}, max_attempts=3)
        deadline = time.monotonic() + 10
        while Queue("boom").count(status=Status.FAILED) == 0 and time.monotonic() < deadline:
            worker_for("boom", burst=True).run()
            time.sleep(0.01)
        stored = QueueItem.objects.get(pk=item.pk)
        assert (stored.status, stored.attempts) == (Status.FAILED, 3)
        assert "Traceback" in stored.last_error
        assert "ValueError: boom {'x': 1}" in stored.last_error

    def test_non_json_result_fails_at_once(self, monkeypatch):
        worker = worker_for("echo", burst=True)
        worker.rotation.handlers["echo"] = lambda item: {1, 2}
        item = Queue("echo").enqueue({}, max_attempts=5)
        worker.run()
        stored = QueueItem.objects.get(pk=item.pk)
        assert (stored.status, stored.attempts) == (Status.FAILED, 1)
        assert "Object of type set is not JSON serializable" in stored.last_error

    @pytest.mark.parametrize(
        ("queue", "error_class"),
        [("exits", "builtins.SystemExit"), ("interrupts", "builtins.KeyboardInterrupt")],
    )
    @pytest.mark.parametrize("concurrency", [1, 3])
    def test_a_handler_raising_systemexit_fails_its_item_not_the_consumer(
        self, queue, error_class, concurrency
    ):
        poison = Queue(queue).enqueue({}, max_attempts=2)
        Queue("echo").enqueue_many([{}] * 3)
        for _ in range(10):  # retried at once (RETRY_DELAY is tiny), then FAILED
            worker = worker_for(queue, "echo", concurrency=concurrency, burst=True)
            assert worker.run() == 0
            if Queue(queue).count(status=Status.FAILED):
                break
            time.sleep(0.01)
        stored = QueueItem.objects.get(pk=poison.pk)
        assert (stored.status, stored.attempts) == (Status.FAILED, 2)
        assert stored.error_class == error_class
        assert error_class.split(".")[1] in stored.last_error
        assert Queue("echo").count(status=Status.DONE) == 3  # the consumer went on

    def test_signals_report_claims_successes_and_failures(self):
        seen = []

        def record(signal_name):
            return lambda sender, item, **kwargs: seen.append((signal_name, item.queue))

        receivers = {
            "claimed": record("claimed"),
            "done": record("done"),
            "failed": record("failed"),
        }
        signals.item_claimed.connect(receivers["claimed"])
        signals.item_done.connect(receivers["done"])
        signals.item_failed.connect(receivers["failed"])
        try:
            Queue("echo").enqueue({})
            Queue("boom").enqueue({}, max_attempts=1)
            worker_for("echo", "boom", burst=True).run()
        finally:
            signals.item_claimed.disconnect(receivers["claimed"])
            signals.item_done.disconnect(receivers["done"])
            signals.item_failed.disconnect(receivers["failed"])
        assert sorted(seen) == [
            ("claimed", "boom"),
            ("claimed", "echo"),
            ("done", "echo"),
            ("failed", "boom"),
        ]


class TestStop:
    @pytest.mark.parametrize("concurrency", [1, 2])
    def test_stop_finishes_running_work_and_releases_the_rest(self, concurrency):
        Queue("slow").enqueue_many([{"seconds": 0.4}] * 6)
        worker = worker_for("slow", concurrency=concurrency, batch=6)
        with running(worker):
            assert wait_for(lambda: Run.objects.count() >= concurrency)
        assert not QueueItem.objects.filter(status=Status.IN_PROGRESS).exists()
        done = Queue("slow").count(status=Status.DONE)
        assert done == Run.objects.count() and 1 <= done < 6
        ready = QueueItem.objects.filter(status=Status.READY)
        assert ready.count() == 6 - done
        assert set(ready.values_list("attempts", flat=True)) == {0}
        assert Consumer.objects.get(identity=worker.identity).stopped_at is not None


class TestClaimAhead:
    """With several handler threads the next batch is claimed while one runs."""

    @pytest.mark.parametrize(("concurrency", "held"), [(1, 2), (2, 4)])
    def test_claimed_ahead_up_to_a_second_batch(self, concurrency, held):
        Queue("slow").enqueue_many([{"seconds": 0.5}] * 8)
        worker = worker_for("slow", concurrency=concurrency, batch=2)
        claimed = QueueItem.objects.filter(status=Status.IN_PROGRESS)
        with running(worker):
            assert wait_for(lambda: Run.objects.count() >= 1)
            time.sleep(0.2)  # time enough to claim ahead, while the first batch runs
            assert claimed.count() == held
        # Stopped: what no handler started went back READY, its attempt uncounted.
        assert not claimed.exists()
        assert Queue("slow").count(status=Status.DONE) == Run.objects.count()


class TestLostConnection:
    @pytest.mark.requires("read_only_standbys")
    def test_a_connection_to_a_server_now_read_only_is_made_again(self, caplog):
        """After a failover, a connection left on the former primary, now a standby, has
        its writes refused as read-only: the consumer drops it and connects again (to the
        new primary, with target_session_attrs=read-write) instead of dying of the error."""
        Queue("echo").enqueue_many([{}] * 3)
        with connections["default"].cursor() as cursor:  # the consumer's loop's connection
            cursor.execute("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY")
        with caplog.at_level(logging.WARNING, logger="django_txqueue.consumer.worker"):
            assert worker_for("echo", burst=True).run() == 0
        assert "database error, retrying in 0.5 s" in caplog.text
        assert "read-only transaction" in caplog.text
        assert Queue("echo").count(status=Status.DONE) == 3
        assert set(QueueItem.objects.values_list("attempts", flat=True)) == {1}

    def test_a_consumer_is_made_without_asking_its_database_what_it_supports(
        self, monkeypatch, caplog
    ):
        """Django 5.2's MySQL backend connects to learn whether the server has SKIP LOCKED:
        asked as the consumer is made, a database down then was a traceback, not a wait.
        It is asked on the first turn, where a database error is one to wait out."""
        Queue("echo").enqueue_many([{}] * 3)
        asked, real = [], store.rides_with_claims

        def rides_with_claims(strategy, alias):
            asked.append(alias)
            if len(asked) == 1:
                raise OperationalError('(2002, "Can\'t connect to server")')
            return real(strategy, alias)

        monkeypatch.setattr(store, "rides_with_claims", rides_with_claims)
        worker = worker_for("echo", burst=True)
        assert asked == []
        with caplog.at_level(logging.WARNING, logger="django_txqueue.consumer.worker"):
            assert worker.run() == 0
        assert asked == ["default", "default"]
        assert "database error, retrying in 0.5 s" in caplog.text
        assert Queue("echo").count(status=Status.DONE) == 3


class TestWakeup:
    """Idle waits are made 30 s long, so only a wake-up explains a pick-up within 1 s."""

    @pytest.fixture(autouse=True)
    def long_polls(self, settings, monkeypatch):
        settings.TXQUEUE = {**settings.TXQUEUE, "POLL_INTERVAL": 30}
        monkeypatch.setattr("django_txqueue.consumer.worker.FIRST_IDLE_WAIT", 30)

    def wakes_for_new_work(self, done=1):
        # Producers look consumers' addresses up at most once a second: a consumer
        # younger than that relies on its poll (README, "Wake-ups").
        time.sleep(ADDRESS_CACHE_SECONDS + 0.2)
        started = time.monotonic()
        Queue("echo").enqueue({"ping": 1})
        assert wait_for(lambda: Queue("echo").count(status=Status.DONE) == done, timeout=5)
        return time.monotonic() - started

    def test_an_idle_consumer_wakes_for_new_work_before_its_poll(self):
        worker = worker_for("echo")
        with running(worker):
            assert wait_for(lambda: Consumer.objects.filter(identity=worker.identity).exists())
            assert self.wakes_for_new_work() < 1

    @pytest.mark.lacks("notify")  # woken by datagrams on the loopback instead
    def test_a_stray_datagram_only_causes_a_poll(self):
        import socket

        # Not due for a minute: a datagram naming its queue must not get it claimed.
        later = Queue("echo").enqueue({"n": "later"}, delay=60)
        worker = worker_for("echo")
        with running(worker) as thread:
            assert wait_for(lambda: Consumer.objects.filter(identity=worker.identity).exists())
            address = Consumer.objects.get(identity=worker.identity).wakeup_address
            assert address, "a consumer without LISTEN/NOTIFY listens for datagrams"
            host, port = address.rsplit(":", 1)
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as stray:
                stray.sendto(b"\xff" * 600, (host, int(port)))  # not UTF-8, over 512 bytes
                stray.sendto(b"", (host, int(port)))
                stray.sendto(b"echo", (host, int(port)))  # a forged wake-up, nothing due
                time.sleep(0.3)
                assert thread.is_alive()
                stored = QueueItem.objects.get(pk=later.pk)
                assert (stored.status, stored.attempts, stored.pid) == (Status.READY, 0, "")
                assert not Run.objects.exists()

                # Still listening after the garbage, and a datagram is a poll, no more: an
                # item inserted with no wake-up of its own is found by the poll it causes
                # (the consumer's idle wait is 30 s), the item not yet due is left alone.
                silent = QueueItem.objects.create(queue="echo", payload={"n": "silent"})
                started = time.monotonic()
                stray.sendto(b"echo", (host, int(port)))
                assert wait_for(
                    lambda: QueueItem.objects.get(pk=silent.pk).status == Status.DONE, timeout=5
                )
                assert time.monotonic() - started < 1
            assert list(Run.objects.values_list("item_id", flat=True)) == [silent.pk]
            assert QueueItem.objects.get(pk=later.pk).status == Status.READY
            assert self.wakes_for_new_work(done=2) < 1  # and producers' wake-ups still work


class TestProgress:
    def test_progress_reports_processed_failed_rate_and_backlog(self):
        reports = []
        Queue("slow").enqueue_many([{"seconds": 0.05}] * 6)
        Queue("boom").enqueue({}, max_attempts=1)
        worker = worker_for(
            "slow", "boom", burst=True, on_progress=reports.append, progress_interval=0.1
        )
        worker.run()
        assert reports, "no progress reported"
        last = reports[-1]
        assert 1 <= last.processed <= 6 and last.failed <= 1
        assert last.rate > 0 and last.backlog >= 0
        assert (worker.processed, worker.failed) == (6, 1)

    def test_an_idle_consumer_reports_once_and_says_when_a_backlog_is_estimated(self):
        reports = []
        worker = worker_for("slow", on_progress=reports.append, progress_interval=0.05)
        with running(worker):
            time.sleep(0.6)  # a dozen intervals with nothing new
        assert len(reports) == 1, reports
        assert (reports[0].processed, reports[0].backlog, reports[0].backlog_text) == (0, 0, "0")
        estimated = Progress(processed=0, failed=0, rate=0.0, backlog=1500, in_flight=0)
        assert estimated.backlog_text == "1500"
        estimated.backlog_exact = False
        assert estimated.backlog_text == "about 1500"
