"""Bounded queues (MAX_SIZE): exact under concurrent producers, free for unbounded queues.

tests/settings.py gives the queue "bounded" a MAX_SIZE of 3.
"""

import json
import subprocess
import sys
import time

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from django_txqueue import Queue, QueueFull, Status
from django_txqueue.models import QueueBound
from django_txqueue.tasks.backend import TASKS_FRAMEWORK

from .helpers import ROOT, child_env


@pytest.fixture
def bounded(db):
    return Queue("bounded")


def test_queue_full_carries_the_unsaved_item_and_the_size_and_writes_nothing(bounded):
    bounded.enqueue_many([{"n": 1}, {"n": 2}])
    bounded.enqueue({"n": 3})
    with pytest.raises(QueueFull) as caught:
        bounded.enqueue({"n": 4}, priority=5)
    assert caught.value.current_size == 3
    assert caught.value.item.pk is None
    assert caught.value.item.payload == {"n": 4} and caught.value.item.priority == 5
    with pytest.raises(QueueFull) as caught:
        bounded.enqueue_many([{"n": 5}, {"n": 6}])
    assert caught.value.current_size == 3 and caught.value.item.payload == {"n": 5}
    assert bounded.count(status=None) == 3


def test_a_batch_fits_whole_or_not_at_all(bounded):
    bounded.enqueue({"n": 1})
    with pytest.raises(QueueFull):
        bounded.enqueue_many([{"n": n} for n in range(3)])
    assert bounded.count() == 1
    assert len(bounded.enqueue_many([{"n": 2}, {"n": 3}])) == 2
    assert bounded.count() == 3


def test_the_bound_counts_ready_and_in_progress_but_not_done_or_failed(bounded):
    bounded.enqueue_many([{"n": n} for n in range(3)])
    done, failed, _running = bounded.claim(3)
    assert done.ack() and failed.fail("gave up")
    bounded.enqueue_many([{"n": 3}, {"n": 4}])  # two freed places
    with pytest.raises(QueueFull) as caught:
        bounded.enqueue({"n": 5})
    assert caught.value.current_size == 3
    statuses = sorted(bounded.items.values_list("status", flat=True))
    assert statuses == [Status.READY, Status.READY, Status.IN_PROGRESS, Status.DONE, Status.FAILED]


@pytest.mark.django_db(transaction=True)
def test_a_refusal_inside_the_callers_transaction_leaves_it_usable():
    bounded = Queue("bounded")
    with transaction.atomic():
        bounded.enqueue_many([{"n": 1}, {"n": 2}, {"n": 3}])
        with pytest.raises(QueueFull):
            bounded.enqueue({"n": 4})
        assert bounded.count() == 3  # the transaction carries on
    assert bounded.count() == 3


@pytest.mark.django_db(transaction=True)
def test_a_rolled_back_transaction_leaves_nothing():
    bounded = Queue("bounded")
    with pytest.raises(RuntimeError), transaction.atomic():
        bounded.enqueue_many([{"n": 1}, {"n": 2}])
        bounded.enqueue({"n": 3})
        raise RuntimeError("the caller gives up")
    assert bounded.count(status=None) == 0
    assert not QueueBound.objects.exists()  # the bound row was the transaction's too
    assert len(bounded.enqueue_many([{"n": n} for n in range(3)])) == 3


def test_dedup_key_still_works_on_a_bounded_queue(bounded):
    first = bounded.enqueue({"n": 1}, dedup_key="k")
    assert bounded.enqueue({"n": 2}, dedup_key="k").pk == first.pk
    bounded.enqueue_many([{"n": 3}, {"n": 4}])
    # Full, but the twin is returned: enqueueing it again adds nothing.
    assert bounded.enqueue({"n": 5}, dedup_key="k").pk == first.pk
    with pytest.raises(QueueFull):
        bounded.enqueue({"n": 6}, dedup_key="other")
    assert bounded.count() == 3


def test_enqueue_on_an_unbounded_queue_runs_exactly_one_query(queue):
    with transaction.atomic(), CaptureQueriesContext(connection) as one:
        queue.enqueue({"n": 1})
    assert len(one.captured_queries) == 1, one.captured_queries
    assert "queueitem" in one.captured_queries[0]["sql"].lower()
    with transaction.atomic(), CaptureQueriesContext(connection) as batch:
        queue.enqueue_many([{"n": 2}, {"n": 3}])
    assert len(batch.captured_queries) == 1, batch.captured_queries
    assert not QueueBound.objects.exists()


def test_a_bounded_enqueue_locks_counts_and_inserts(bounded):
    with transaction.atomic(), CaptureQueriesContext(connection) as captured:
        bounded.enqueue({"n": 1})
    statements = [q["sql"].lower() for q in captured.captured_queries]
    assert len(statements) == 3, statements
    assert "queuebound" in statements[0] and "count" in statements[1]
    assert "insert" in statements[2] and "queueitem" in statements[2]


PRODUCER = """
import json, sys, time
import django
django.setup()
from django.db import transaction
from django_txqueue import QueueFull, enqueue
queue, attempts, start_at = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
time.sleep(max(0.0, start_at - time.time()))
enqueued = refused = largest_refused_size = 0
for n in range(attempts):
    try:
        with transaction.atomic():
            enqueue(queue, {"n": n})
            time.sleep(0.01)  # hold the transaction open: widens the race at the limit
        enqueued += 1
    except QueueFull as full:
        assert full.item.pk is None and full.item.payload == {"n": n}
        largest_refused_size = max(largest_refused_size, full.current_size)
        refused += 1
print(json.dumps({"enqueued": enqueued, "refused": refused, "size": largest_refused_size}))
"""

MAX_SIZE = 50
PRODUCERS = 8
ATTEMPTS = 12


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_eight_concurrent_producers_never_exceed_max_size():
    queue = Queue("bounded-race")
    env = {
        **child_env(),
        "TXQUEUE_TEST_SETTINGS": json.dumps({"QUEUES": {queue.name: {"MAX_SIZE": MAX_SIZE}}}),
    }
    start_at = str(time.time() + 1.5)
    children = [
        subprocess.Popen(
            [sys.executable, "-c", PRODUCER, queue.name, str(ATTEMPTS), start_at],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=ROOT,
        )
        for _ in range(PRODUCERS)
    ]
    largest = 0
    while any(child.poll() is None for child in children):
        largest = max(largest, queue.count(status=None))
        time.sleep(0.02)
    reports = []
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err.decode()
        reports.append(json.loads(out))

    assert largest <= MAX_SIZE, f"{largest} unfinished items seen"
    assert max(r["size"] for r in reports) == MAX_SIZE  # what QueueFull reported
    assert queue.count(status=None) == MAX_SIZE == queue.count(Status.READY)
    assert sum(r["enqueued"] for r in reports) == MAX_SIZE
    assert all(r["enqueued"] + r["refused"] == ATTEMPTS for r in reports)
    assert sum(1 for r in reports if r["enqueued"]) >= 2, "the producers did not overlap"
    # The race reached the limit: some producers were refused.
    assert sum(r["refused"] for r in reports) == PRODUCERS * ATTEMPTS - MAX_SIZE


@pytest.mark.skipif(TASKS_FRAMEWORK is None, reason="no Django Tasks framework installed")
def test_the_tasks_backend_goes_through_the_bound(db, settings):
    from tests.testapp.tasks import add

    settings.TXQUEUE = {"QUEUES": {"default": {"MAX_SIZE": 1}}}
    add.enqueue(1, 2)
    with pytest.raises(QueueFull) as caught:
        add.enqueue(3, 4)
    assert caught.value.current_size == 1 and caught.value.item.payload["args"] == [3, 4]
    assert Queue("default").count() == 1
