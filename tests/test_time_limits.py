"""A queue's ``TIMEOUT`` stops a handler (docs/limits.md): its item's attempt fails with
``ItemTimeout`` and the consumer stops, to exit ``ITEM_TIMEOUT_EXIT``; handlers read
``item.time_left()``. With real processes: tests/e2e/test_limits_processes.py."""

import threading
import time

import pytest

from django_txqueue import ItemTimeout, Queue, Status
from django_txqueue.consumer.timeouts import ITEM_TIMEOUT_EXIT
from django_txqueue.consumer.worker import Worker
from django_txqueue.models import QueueItem

from .test_admin import DASHBOARD


def timeout(queue, settings, seconds):
    settings.TXQUEUE = {
        **settings.TXQUEUE,
        "SHUTDOWN_TIMEOUT": 5,
        "QUEUES": {queue.name: {"TIMEOUT": seconds}},
    }


@pytest.mark.django_db
def test_time_left_is_none_without_a_limit_and_counts_down_with_one(queue, settings):
    queue.enqueue({"n": 1})
    assert queue.claim(1, pid="a")[0].time_left() is None
    timeout(queue, settings, 60)
    queue.enqueue({"n": 2})
    left = queue.claim(1, pid="a")[0].time_left()
    assert 55 < left <= 60  # claimed by hand: counted from claimed_at


@pytest.mark.django_db(transaction=True)
def test_a_handler_reads_the_time_it_has_left(queue, settings):
    timeout(queue, settings, 30)
    queue.enqueue({"n": 1})
    seen = []

    def handle(item):
        seen.append(item.time_left())
        time.sleep(0.3)
        seen.append(item.time_left())

    assert Worker({queue.name: handle}, burst=True).run() == 0
    assert 29.5 < seen[0] <= 30
    assert 0.25 < seen[0] - seen[1] < 1.0


@pytest.mark.django_db(transaction=True)
def test_a_hung_handler_fails_its_attempt_and_stops_the_consumer(queue, settings):
    timeout(queue, settings, 0.5)
    hung = queue.enqueue({"hang": True})
    others = queue.enqueue_many([{"n": n} for n in range(6)])
    release = threading.Event()
    done = []

    def handle(item):
        if item.payload.get("hang"):
            release.wait(60)  # a socket with no timeout, say
        else:
            time.sleep(0.05)
            done.append(item.pk)

    worker = Worker({queue.name: handle}, concurrency=2, batch=2, burst=True)
    started = time.monotonic()
    try:
        code = worker.run()
    finally:
        release.set()
    assert code == ITEM_TIMEOUT_EXIT == 75
    assert time.monotonic() - started < 5
    hung.refresh_from_db()
    assert hung.status == Status.READY  # attempts left: retried, as any failure
    assert (hung.attempts, hung.error_class) == (1, "django_txqueue.ItemTimeout")
    assert "ran past its TIMEOUT of 0.5 s" in hung.last_error
    assert "release.wait(60)" in hung.last_error  # where its thread was
    assert hung.error_class == ItemTimeout.NAME
    # The others: done by the free thread, or released unstarted, attempt uncounted.
    rest = QueueItem.objects.filter(pk__in=[item.pk for item in others])
    assert set(rest.filter(status=Status.DONE).values_list("pk", flat=True)) == set(done)
    assert set(rest.exclude(status=Status.DONE).values_list("status", "attempts")) <= {
        (Status.READY, 0)
    }


@pytest.mark.django_db(transaction=True)
def test_a_hung_handler_on_its_last_attempt_ends_failed(queue, settings):
    timeout(queue, settings, 0.3)
    hung = queue.enqueue({"hang": True}, max_attempts=1)
    release = threading.Event()
    try:
        code = Worker({queue.name: lambda item: release.wait(60)}, burst=True).run()
    finally:
        release.set()
    assert code == ITEM_TIMEOUT_EXIT
    hung.refresh_from_db()
    assert (hung.status, hung.error_class) == (Status.FAILED, "django_txqueue.ItemTimeout")


@pytest.mark.django_db(transaction=True)
def test_every_hung_handler_fails_and_one_still_running_at_the_end_is_released(queue, settings):
    other = Queue(f"{queue.name}-other")  # no TIMEOUT: its handler is slow, not hung
    settings.TXQUEUE = {
        **settings.TXQUEUE,
        "SHUTDOWN_TIMEOUT": 0.5,
        "QUEUES": {queue.name: {"TIMEOUT": 1.0}},
    }
    hung = queue.enqueue_many([{"n": 1}, {"n": 2}])
    slow = other.enqueue({"n": 3})
    release = threading.Event()

    def handle(item):
        release.wait(60)

    worker = Worker({queue.name: handle, other.name: handle}, concurrency=3, burst=True)
    try:
        assert worker.run() == ITEM_TIMEOUT_EXIT
    finally:
        release.set()
    for item in QueueItem.objects.filter(pk__in=[item.pk for item in hung]):
        assert (item.status, item.attempts) == (Status.READY, 1)
        assert item.error_class == "django_txqueue.ItemTimeout"
    # Still running when the shutdown timeout ran out: back READY, its attempt uncounted.
    slow.refresh_from_db()
    assert (slow.status, slow.attempts, slow.error_class) == (Status.READY, 0, "")


@pytest.mark.django_db(transaction=True)
def test_handlers_within_their_timeout_run_as_before(queue, settings):
    timeout(queue, settings, 5)
    queue.enqueue_many([{"n": n} for n in range(5)])
    worker = Worker({queue.name: lambda item: time.sleep(0.01)}, concurrency=2, burst=True)
    assert worker.run() == 0
    assert worker.processed == 5


@pytest.mark.django_db
def test_the_limit_is_shown(queue, settings, admin_client):
    timeout(queue, settings, 30)
    queue.enqueue({"n": 1})
    assert queue.stats()["timeout"] == 30
    page = admin_client.get(DASHBOARD).content.decode()
    assert 'title="TIMEOUT: a handler past it is stopped">≤ 30 s</span>' in page
