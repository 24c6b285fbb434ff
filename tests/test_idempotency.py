"""once(): an external effect recorded once, however often the handler that causes it runs."""

import os
import subprocess
import sys
import threading

import pytest
from django.db import connections, transaction

from django_txqueue import Queue, Status, enqueue, once
from django_txqueue.consumer import registry
from django_txqueue.models import Effect
from tests.helpers import ROOT, child_env
from tests.testapp import gateway
from tests.testapp.models import Run

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def gateway_log(tmp_path, monkeypatch):
    """The fake provider's delivery log, passed on to child processes."""
    monkeypatch.setenv("TXQUEUE_TEST_GATEWAY", str(tmp_path / "delivered.jsonl"))


class TestOnce:
    def test_true_the_first_time_false_once_recorded(self):
        with once("sms:1") as first:
            assert first
        with once("sms:1") as first:
            assert not first
        assert list(Effect.objects.values_list("key", flat=True)) == ["sms:1"]

    def test_the_blocks_writes_commit_with_the_record(self):
        with once("sms:2") as first:
            assert first
            Run.objects.create(item_id=2, consumer="bookkeeping")
            assert connections["default"].in_atomic_block
        assert Run.objects.filter(item_id=2).count() == 1

    def test_an_exception_in_the_block_rolls_the_record_back(self):
        with pytest.raises(ZeroDivisionError), once("sms:3") as first:
            assert first
            Run.objects.create(item_id=3, consumer="bookkeeping")
            1 / 0  # noqa: B018
        assert not Effect.objects.exists()
        assert not Run.objects.exists()
        with once("sms:3") as first:  # the effect did not happen: the next run does it
            assert first

    def test_nested_it_commits_or_rolls_back_with_the_outer_transaction(self):
        with pytest.raises(ZeroDivisionError), transaction.atomic():
            with once("sms:4") as first:
                assert first
            1 / 0  # noqa: B018
        assert not Effect.objects.exists()

    def test_a_recorded_key_leaves_the_callers_transaction_usable(self):
        """The duplicate insert fails in a savepoint of its own (PostgreSQL would
        otherwise refuse every later statement of the transaction)."""
        with once("sms:5"):
            pass
        with transaction.atomic():
            with once("sms:5") as first:
                assert not first
            Run.objects.create(item_id=5, consumer="after")
        assert Run.objects.filter(item_id=5).exists()

    @pytest.mark.parametrize(
        ("key", "error", "message"),
        [
            (None, TypeError, "must be a string, not None"),
            (5, TypeError, "must be a string, not int"),
            ("", ValueError, "must be 1 to 255 characters, got 0"),
            ("k" * 256, ValueError, "must be 1 to 255 characters, got 256"),
        ],
    )
    def test_a_bad_key_is_refused_before_anything_is_written(self, key, error, message):
        with pytest.raises(error, match=f"the effect key {message}"), once(key):
            pass
        assert not Effect.objects.exists()


def run_once_in_thread(key, results, entered=None, leave=None, fail=False):
    """``once(key)`` on a thread of its own (its own connection); appends what it yields."""

    def run():
        try:
            with once(key) as first:
                results.append(first)
                if entered is not None:
                    entered.set()
                    leave.wait(10)
                if fail:
                    raise RuntimeError("the effect failed")
        except RuntimeError:
            pass
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


class TestConcurrentRuns:
    @pytest.mark.parametrize("first_commits", [True, False], ids=["commits", "rolls back"])
    def test_a_concurrent_run_waits_for_the_first_one(self, first_commits):
        """The second run waits on the first's uncommitted record: if the first commits,
        the second skips; if it rolls back (the effect failed), the second does it."""
        results_first, results_second = [], []
        entered, leave = threading.Event(), threading.Event()
        first = run_once_in_thread("race", results_first, entered, leave, fail=not first_commits)
        assert entered.wait(10)
        second = run_once_in_thread("race", results_second)
        second.join(0.5)
        assert second.is_alive() and results_second == []  # waiting for the first
        leave.set()
        first.join(10)
        second.join(20)
        assert results_first == [True]
        assert results_second == [not first_commits]
        assert Effect.objects.filter(key="race").count() == 1


class TestAnSmsHandler:
    """tests/testapp/queues.py's ``sms`` handler: gateway.send inside ``once``."""

    def test_a_handler_run_twice_sends_one_sms(self):
        enqueue("sms", {"booking": 7, "to": "+15550100"})
        [item] = Queue("sms").claim()
        registry.autodiscover()  # tests/testapp/queues.py, whichever test ran before
        send_sms = registry.handlers()["sms"]
        send_sms(item)
        send_sms(item)  # as after a rescue: the item runs again
        assert gateway.delivered() == [
            {"to": "+15550100", "text": "Booking 7 confirmed", "pid": os.getpid()}
        ]
        assert Run.objects.filter(consumer="sms").count() == 1

    @pytest.mark.slow
    def test_consumer_processes_racing_on_one_booking_send_one_sms_each(self):
        """Four items per booking (no dedup_key), drained by three consumer processes at
        once, each holding its transaction open a moment so that runs overlap."""
        bookings = range(1, 6)
        for _ in range(4):
            Queue("sms").enqueue_many(
                [{"booking": b, "to": f"+1555010{b}", "linger": 0.05} for b in bookings]
            )
        command = [sys.executable, "-m", "django", "run_queue_consumer", "sms", "--burst"]
        consumers = [
            subprocess.Popen(command, env=child_env(), cwd=ROOT)  # noqa: S603
            for _ in range(3)
        ]
        assert [consumer.wait(60) for consumer in consumers] == [0, 0, 0]
        assert Queue("sms").count(Status.DONE) == 20
        delivered = sorted(message["to"] for message in gateway.delivered())
        assert delivered == [f"+1555010{b}" for b in bookings]
        assert Run.objects.filter(consumer="sms").count() == 5
