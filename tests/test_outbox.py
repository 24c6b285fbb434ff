"""The durable on_commit: stored in the caller's transaction, run once after commit."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest
from django.db import transaction

from django_txqueue import Queue, Status, on_commit
from django_txqueue.consumer import registry
from django_txqueue.consumer.worker import Worker
from django_txqueue.models import QueueItem
from django_txqueue.outbox import QUEUE
from tests.helpers import ROOT, child_env, wait_for
from tests.testapp import calls
from tests.testapp.models import Run

pytestmark = pytest.mark.django_db(transaction=True)


def runs(label):
    """(pid, count) of the runs of ``label``."""
    return list(Run.objects.filter(consumer=label).values_list("item_id", flat=True))


def calls_stored():
    return QueueItem.objects.filter(queue=QUEUE)


class TestInTheCommittingProcess:
    def test_runs_once_after_commit_in_this_process(self):
        with transaction.atomic():
            on_commit(calls.record, "booked")
            assert runs("booked") == []  # not before the commit
            assert calls_stored().count() == 1  # the call is a row of this transaction
        assert runs("booked") == [os.getpid()]
        [item] = calls_stored()
        assert (item.status, item.attempts) == (Status.DONE, 1)
        assert item.payload == {
            "func": "tests.testapp.calls.record",
            "args": ["booked"],
            "kwargs": {},
        }

    def test_a_consumer_afterwards_does_not_run_it_again(self, run_consumer):
        with transaction.atomic():
            on_commit(calls.record, "once", times=1)
        run_consumer("--burst")
        assert runs("once") == [os.getpid()]

    def test_rollback_drops_the_call_for_good(self, run_consumer):
        with pytest.raises(ZeroDivisionError), transaction.atomic():
            on_commit(calls.record, "rolled back")
            1 / 0  # noqa: B018
        run_consumer("--burst")
        assert runs("rolled back") == []
        assert not calls_stored().exists()

    def test_a_savepoint_rollback_drops_only_the_calls_inside_it(self):
        with transaction.atomic():
            on_commit(calls.record, "outer")
            with pytest.raises(ZeroDivisionError), transaction.atomic():
                on_commit(calls.record, "inner")
                1 / 0  # noqa: B018
        assert runs("outer") == [os.getpid()]
        assert runs("inner") == []
        assert calls_stored().count() == 1

    def test_outside_a_transaction_it_runs_at_once_and_stores_nothing(self):
        on_commit(calls.record, "now")
        assert runs("now") == [os.getpid()]
        assert not calls_stored().exists()

    def test_an_error_is_kept_and_a_consumer_retries_the_call(self, settings, run_consumer):
        settings.TXQUEUE = {**settings.TXQUEUE, "RETRY_DELAY": 0.001, "RETRY_MAX_DELAY": 0.001}
        with transaction.atomic():
            on_commit(calls.fails_once, "flaky")  # the caller's commit still stands
        [item] = calls_stored()
        assert (item.status, item.error_class) == (Status.READY, "builtins.RuntimeError")
        assert "first call of flaky fails" in item.last_error
        time.sleep(0.01)
        run_consumer("--burst")
        assert len(runs("flaky")) == 1
        item.refresh_from_db()
        assert (item.status, item.attempts) == (Status.DONE, 2)


class Booking:
    def confirm(self):
        pass


class TestBusyConsumers:
    def test_a_busy_consumer_runs_an_orphaned_call_within_poll_interval(self, settings):
        """Not only at start or when idle: a consumer busy with another queue looks for
        orphaned calls at least every POLL_INTERVAL. It is never woken for them."""
        settings.TXQUEUE = {**settings.TXQUEUE, "POLL_INTERVAL": 0.2}
        Queue("slow").enqueue_many([{"seconds": 0.05}] * 80)  # 4 s of work, one at a time
        registry.autodiscover()
        worker = Worker(handlers={"slow": registry.handlers()["slow"]}, burst=True)
        assert QUEUE not in worker.rotation.woken_for()
        thread = threading.Thread(target=worker.run)
        thread.start()
        try:
            assert wait_for(lambda: Run.objects.count() >= 3)  # busy
            QueueItem.objects.create(  # a call whose committing process died
                queue=QUEUE,
                payload={"func": "tests.testapp.calls.record", "args": ["orphan"], "kwargs": {}},
            )
            assert wait_for(lambda: runs("orphan"), timeout=5)
            assert Queue("slow").count() > 0  # it ran while the other queue was still busy
        finally:
            worker.stop()
            thread.join(10)
        assert not thread.is_alive()


class TestBadCalls:
    @pytest.mark.parametrize(
        "func",
        [lambda: None, Booking().confirm, Run.objects.create, Booking.confirm],
        ids=["lambda", "bound method", "manager method", "method of a class"],
    )
    def test_functions_that_cannot_be_found_again_are_refused(self, func):
        refused = pytest.raises(ValueError, match="importable module-level function")
        with refused, transaction.atomic():
            on_commit(func)
        assert not calls_stored().exists()

    def test_a_nested_function_is_refused(self):
        def nested():
            pass

        with pytest.raises(ValueError, match="nested"), transaction.atomic():
            on_commit(nested)
        assert not calls_stored().exists()

    def test_arguments_must_be_json(self):
        not_json = pytest.raises(TypeError, match="Object of type set is not JSON serializable")
        with not_json, transaction.atomic():
            on_commit(calls.record, {1, 2})
        with pytest.raises(TypeError, match="keyword arguments.*object"), transaction.atomic():
            on_commit(calls.record, "x", times=object())
        assert not calls_stored().exists()
        assert Run.objects.count() == 0


def python(code, **settings):
    """Run ``code`` in a child process on this test database; returns it finished."""
    env = {**child_env(), "TXQUEUE_TEST_SETTINGS": json.dumps(settings)}
    script = "import django; django.setup()\n" + code
    return subprocess.run(  # noqa: S603 - our own interpreter and code
        [sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, timeout=60
    )


class TestWhenTheCommittingProcessDies:
    def test_a_consumer_started_afterwards_runs_the_call_exactly_once(self, run_consumer):
        """The process commits, then dies before its on_commit call runs."""
        died = python(
            "import os\n"
            "from django.db import transaction\n"
            "from django_txqueue import on_commit\n"
            "from tests.testapp import calls\n"
            "with transaction.atomic():\n"
            "    transaction.on_commit(lambda: os._exit(0))  # runs first: dies after commit\n"
            "    on_commit(calls.record, 'orphan')\n"
        )
        assert died.returncode == 0, died.stderr.decode()
        [item] = calls_stored()
        assert (item.status, item.attempts) == (Status.READY, 0)  # committed, never run

        run_consumer("--burst")  # no queue names, no wait for a lease
        assert runs("orphan") == [os.getpid()]
        run_consumer("--burst")
        assert len(runs("orphan")) == 1
        item.refresh_from_db()
        assert item.status == Status.DONE

    def test_a_call_that_died_half_way_is_rescued_like_a_stuck_item(self, run_consumer):
        died = python(
            "from django.db import transaction\n"
            "from django_txqueue import on_commit\n"
            "from tests.testapp import calls\n"
            "with transaction.atomic():\n"
            "    on_commit(calls.exit_now, 'halfway')\n",
            QUEUES={QUEUE: {"LEASE": 0.5}},
        )
        assert died.returncode == 0, died.stderr.decode()
        [item] = calls_stored()
        assert (item.status, item.attempts) == (Status.IN_PROGRESS, 1)
        assert len(runs("halfway:started")) == 1

        time.sleep(0.6)  # its lease runs out: stuck
        assert calls_stored().stuck().exists()
        assert QueueItem.objects.requeue_stuck() == 1
        # The consumer runs it again: at least once. exit_now would end the test process,
        # so the rescued call is checked as READY for any consumer, attempt counted.
        item.refresh_from_db()
        assert (item.status, item.attempts) == (Status.READY, 1)
