"""``MAX_IN_FLIGHT`` (docs/limits.md): at most N items of a queue running at once, across
every consumer; claims take no more than the places left."""

import io
import threading
import time

import pytest
from django.core.management import call_command

from django_txqueue import Status
from django_txqueue.checks import check_settings
from django_txqueue.consumer.worker import Worker

from .test_admin import DASHBOARD

LONG = 600


@pytest.fixture
def capped(queue, settings):
    settings.TXQUEUE = {**settings.TXQUEUE, "QUEUES": {queue.name: {"MAX_IN_FLIGHT": 2}}}
    return queue


@pytest.mark.django_db
def test_a_claim_takes_no_more_than_the_places_left(capped):
    capped.enqueue_many([{"n": n} for n in range(5)])
    first = capped.claim(10, pid="a", lease=LONG)
    assert len(first) == 2
    assert capped.claim(10, pid="b", lease=LONG) == []
    assert first[0].ack() is True
    assert len(capped.claim(10, pid="b", lease=LONG)) == 1
    assert capped.count(Status.IN_PROGRESS) == 2


@pytest.mark.django_db
def test_failed_and_retried_items_free_their_place(capped):
    capped.enqueue_many([{"n": n} for n in range(3)])
    held = capped.claim(10, pid="a", lease=LONG)
    assert held[0].retry("busy", delay=LONG) is True
    assert held[1].fail("bad") is True
    assert [item.payload for item in capped.claim(10, pid="b", lease=LONG)] == [{"n": 2}]


@pytest.mark.django_db(transaction=True)
def test_a_consumer_with_more_threads_runs_no_more_than_the_cap(capped):
    capped.enqueue_many([{"n": n} for n in range(12)])
    running, most, lock = [0], [0], threading.Lock()

    def handle(item):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.02)
        with lock:
            running[0] -= 1

    worker = Worker({capped.name: handle}, concurrency=4, batch=4, burst=True)
    assert worker.run() == 0
    assert worker.processed == 12
    assert most[0] == 2


def test_max_in_flight_is_checked(settings):
    settings.TXQUEUE = {"QUEUES": {"sms": {"MAX_IN_FLIGHT": 0}}}
    found = [m.msg for m in check_settings() if m.id == "txqueue.E003"]
    assert found == [
        "TXQUEUE['QUEUES']['sms']['MAX_IN_FLIGHT'] is 0; it must be None or a positive integer."
    ]


@pytest.mark.django_db
def test_the_cap_and_its_use_are_shown(capped, admin_client):
    capped.enqueue_many([{"n": n} for n in range(3)])
    capped.claim(1, pid="a", lease=LONG)
    assert capped.stats()["max_in_flight"] == 2
    out = io.StringIO()
    call_command("txqueue_stats", capped.name, stdout=out)
    assert f"{capped.name}: 1 in progress of MAX_IN_FLIGHT 2" in out.getvalue()
    page = admin_client.get(DASHBOARD).content.decode()
    row = page[page.index(f'data-queue="{capped.name}"') :]
    cell = row[row.index('data-column="in_progress"') : row.index('data-column="waiting"')]
    assert ">1</a>" in cell and 'title="MAX_IN_FLIGHT">/ 2</span>' in cell
