"""``async def`` handlers run as coroutines on the consumer's event loop (docs/async.md):
``concurrency`` of them at once, beside sync handlers in one consumer, with retries,
fencing, cancellation, time limits and shutdown. With real processes:
tests/e2e/test_async_processes.py."""

import asyncio
import threading
import time

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.db.models import F

from django_txqueue import ItemTimeout, Queue, Status, handler
from django_txqueue.consumer import registry
from django_txqueue.consumer.timeouts import ITEM_TIMEOUT_EXIT
from django_txqueue.consumer.worker import Worker
from django_txqueue.models import QueueItem
from django_txqueue.testing import drain
from tests.helpers import running, wait_for
from tests.testapp.models import Run

pytestmark = pytest.mark.django_db(transaction=True)


def limits(queue, settings, **options):
    settings.TXQUEUE = {**settings.TXQUEUE, "SHUTDOWN_TIMEOUT": 5, "QUEUES": {queue.name: options}}


def handler_threads():
    return [t for t in threading.enumerate() if t.name.startswith("txqueue-handler-")]


def test_coroutines_run_side_by_side_on_the_loop_with_the_orm_and_no_handler_thread(queue):
    items = queue.enqueue_many([{"n": n} for n in range(20)])
    now, most, threads = [0], [0], set()

    async def handle(item):
        threads.add(threading.current_thread().name)
        now[0] += 1
        most[0] = max(most[0], now[0])
        await asyncio.sleep(0.3)
        await Run.objects.acreate(item_id=item.pk, consumer=item.pid)
        now[0] -= 1
        return {"doubled": item.payload["n"] * 2}

    began = time.monotonic()
    worker = Worker({queue.name: handle}, concurrency=20, burst=True)
    assert worker.run() == 0
    took = time.monotonic() - began
    assert most[0] == 20 and took < 3.0  # one after another: 6 s
    assert threads == {"txqueue-event-loop"}
    assert handler_threads() == []
    done = {item.pk: item.result for item in queue.items.filter(status=Status.DONE)}
    assert done == {item.pk: {"doubled": item.payload["n"] * 2} for item in items}
    assert Run.objects.filter(item_id__in=list(done)).count() == 20


def test_concurrency_caps_the_coroutines_running_at_once(queue):
    queue.enqueue_many([{"n": n} for n in range(12)])
    now, most = [0], [0]

    async def handle(item):
        now[0] += 1
        most[0] = max(most[0], now[0])
        await asyncio.sleep(0.05)
        now[0] -= 1

    assert Worker({queue.name: handle}, concurrency=3, burst=True).run() == 0
    assert most[0] == 3 and queue.count(Status.DONE) == 12


def test_one_consumer_serves_sync_and_async_handlers(queue):
    other = Queue(f"{queue.name}-sync")
    queue.enqueue_many([{"n": n} for n in range(5)])
    other.enqueue_many([{"n": n} for n in range(5)])
    where = {}

    async def handle_async(item):
        await asyncio.sleep(0.01)
        where[item.pk] = threading.current_thread().name

    def handle_sync(item):
        where[item.pk] = threading.current_thread().name

    worker = Worker({queue.name: handle_async, other.name: handle_sync}, concurrency=2, burst=True)
    assert worker.run() == 0
    assert queue.count(Status.DONE) == 5 and other.count(Status.DONE) == 5
    by_queue = {i.pk: i.queue for i in QueueItem.objects.filter(pk__in=list(where))}
    assert {where[pk] for pk, name in by_queue.items() if name == queue.name} == {
        "txqueue-event-loop"
    }
    assert all(
        where[pk].startswith("txqueue-handler-") for pk in by_queue if by_queue[pk] != queue.name
    )


def test_an_exception_is_a_failed_attempt_retried_by_the_handlers_rules(queue, settings):
    settings.TXQUEUE = {**settings.TXQUEUE, "RETRY_DELAY": 0.001, "RETRY_MAX_DELAY": 0.001}
    flaky, bad = queue.enqueue({"kind": "flaky"}), queue.enqueue({"kind": "bad"})

    @handler(queue.name, discard_on=ValueError)
    async def handle(item):
        await asyncio.sleep(0)
        if item.payload["kind"] == "bad":
            raise ValueError("never retried")
        if item.attempts < 2:
            raise ConnectionError("try again")
        return "ok"

    try:
        assert Worker({queue.name: handle}, burst=True).run() == 0
    finally:
        registry.unregister(queue.name)
    flaky.refresh_from_db()
    bad.refresh_from_db()
    assert (flaky.status, flaky.attempts, flaky.result) == (Status.DONE, 2, "ok")
    assert (bad.status, bad.attempts, bad.error_class) == (Status.FAILED, 1, "builtins.ValueError")
    assert "never retried" in bad.last_error


def test_a_result_json_cannot_hold_fails_the_item_at_once(queue):
    item = queue.enqueue({"n": 1})

    async def handle(item):
        return {1, 2}

    assert Worker({queue.name: handle}, burst=True).run() == 0
    item.refresh_from_db()
    assert item.status == Status.FAILED and "NotJSONSerializable" in item.error_class


def test_a_coroutine_past_its_timeout_is_stopped_and_the_consumer_goes_on(queue, settings):
    limits(queue, settings, TIMEOUT=0.3, MAX_ATTEMPTS=1)
    slow = queue.enqueue({"seconds": 30})
    quick = queue.enqueue_many([{"seconds": 0} for _ in range(5)])
    stopped = []

    async def handle(item):
        try:
            await asyncio.sleep(item.payload["seconds"])
        except asyncio.CancelledError:
            stopped.append(item.pk)
            raise

    began = time.monotonic()
    assert Worker({queue.name: handle}, concurrency=2, burst=True).run() == 0
    assert time.monotonic() - began < 5
    slow.refresh_from_db()
    assert (slow.status, slow.error_class) == (Status.FAILED, ItemTimeout.NAME)
    assert "TIMEOUT of 0.3 s" in slow.last_error and stopped == [slow.pk]
    assert queue.items.filter(pk__in=[i.pk for i in quick], status=Status.DONE).count() == 5


def test_a_coroutine_that_blocks_the_loop_past_its_timeout_stops_the_consumer(queue, settings):
    limits(queue, settings, TIMEOUT=0.3, MAX_ATTEMPTS=1)
    hung = queue.enqueue({"n": 1})

    async def handle(item):
        time.sleep(2.5)  # sync I/O in an async def: the loop cannot stop it

    began = time.monotonic()
    assert Worker({queue.name: handle}, burst=True).run() == ITEM_TIMEOUT_EXIT
    assert time.monotonic() - began < 10
    hung.refresh_from_db()
    assert (hung.status, hung.error_class) == (Status.FAILED, ItemTimeout.NAME)
    assert "time.sleep(2.5)" in hung.last_error  # where the loop's thread was


def test_cancel_stops_a_running_coroutine_at_once(queue, fast_consumers):
    item = queue.enqueue({"n": 1})
    started, stopped = threading.Event(), []

    async def handle(item):
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            stopped.append(time.monotonic())
            raise

    worker = Worker({queue.name: handle})
    with running(worker):
        assert started.wait(10)
        asked = time.monotonic()
        assert QueueItem.objects.get(pk=item.pk).cancel()
        wait_for(lambda: QueueItem.objects.get(pk=item.pk).status == Status.CANCELLED)
    assert stopped and stopped[0] - asked < 2.0  # a heartbeat and a look, not 30 s


def test_a_coroutine_longer_than_its_lease_keeps_it_and_runs_once(queue, fast_consumers):
    item = queue.enqueue({"n": 1})
    runs = []

    async def handle(item):
        runs.append(item.claim_token)
        await asyncio.sleep(2.0)  # four leases: the heartbeat renews it meanwhile
        return "kept"

    with running(Worker({queue.name: handle}, lease=0.5)):
        wait_for(lambda: QueueItem.objects.get(pk=item.pk).status == Status.DONE, timeout=15)
    row = QueueItem.objects.get(pk=item.pk)
    assert (row.result, row.attempts, len(runs)) == ("kept", 1, 1)


def test_an_acknowledgement_after_the_claim_was_taken_over_is_refused(queue):
    item = queue.enqueue({"n": 1})
    returned = threading.Event()

    async def handle(item):
        # Another consumer took the item over meanwhile (its lease ran out): a new claim.
        await QueueItem.objects.filter(pk=item.pk).aupdate(claim_token=F("claim_token") + 1)
        returned.set()
        return "stale"

    worker = Worker({queue.name: handle})
    with running(worker):  # its shutdown settles what the handler came to
        assert returned.wait(10)
    row = QueueItem.objects.get(pk=item.pk)
    assert (row.status, row.result) == (Status.IN_PROGRESS, None)


def test_a_shutdown_lets_coroutines_finish_within_its_timeout(queue):
    items = queue.enqueue_many([{"n": n} for n in range(4)])
    started = threading.Event()

    async def handle(item):
        started.set()
        await asyncio.sleep(0.3)

    worker = Worker({queue.name: handle}, concurrency=4, shutdown_timeout=5)
    with running(worker):
        assert started.wait(10)
    assert queue.items.filter(pk__in=[i.pk for i in items], status=Status.DONE).count() == 4


def test_past_the_shutdown_timeout_coroutines_are_cancelled_and_their_items_go_back(queue):
    item = queue.enqueue({"n": 1})
    started, cancelled = threading.Event(), []

    async def handle(item):
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(item.pk)
            raise

    worker = Worker({queue.name: handle}, shutdown_timeout=0.3)
    began = time.monotonic()
    with running(worker):
        assert started.wait(10)
    assert time.monotonic() - began < 5 and cancelled == [item.pk]
    row = QueueItem.objects.get(pk=item.pk)
    assert (row.status, row.attempts, row.claim_token) == (Status.READY, 0, None)


def test_progress_from_a_coroutine_is_written_off_the_loop(queue):
    item = queue.enqueue({"n": 1})

    async def handle(item):
        for done in range(1, 4):
            await item.areport_progress(done, 3, f"step {done}")

    assert Worker({queue.name: handle}, burst=True).run() == 0
    row = QueueItem.objects.get(pk=item.pk)
    assert row.status == Status.DONE
    assert row.progress == {"done": 3, "total": 3, "message": "step 3"}  # the one held back


def test_atomic_is_refused_for_an_async_handler():
    with pytest.raises(TypeError, match="atomic=True needs a sync handler"):

        @handler("async-atomic", atomic=True)
        async def handle(item):
            pass

    assert "async-atomic" not in registry.handlers()


def test_drain_runs_async_handlers_in_the_tests_thread_and_transaction(queue):
    queue.enqueue_many([{"n": n} for n in range(3)])

    @handler(queue.name)
    async def handle(item):
        await Run.objects.acreate(item_id=item.pk, consumer=item.pid)
        return item.payload["n"]

    try:
        drained = drain(queue.name)
    finally:
        registry.unregister(queue.name)
    assert drained["done"] == 3 and [i.result for i in drained.items] == [0, 1, 2]
    assert Run.objects.count() == 3


@pytest.mark.django_db
def test_drain_sees_the_tests_own_transaction():
    """In a TestCase-style test (one transaction rolled back at the end), an async
    handler's ORM calls run in the test's thread, so they see its uncommitted rows."""
    queue = Queue("async-drain")
    queue.enqueue({"n": 1})
    Run.objects.create(item_id=0, consumer="seen")

    @handler(queue.name)
    async def handle(item):
        return await Run.objects.filter(consumer="seen").acount()

    try:
        drained = drain(queue.name)
    finally:
        registry.unregister(queue.name)
    assert drained.items[0].result == 1


def test_sync_to_async_work_in_a_handler_does_not_block_other_coroutines(queue):
    queue.enqueue_many([{"n": n} for n in range(2)])
    order = []

    async def handle(item):
        if item.payload["n"] == 0:
            await sync_to_async(time.sleep, thread_sensitive=False)(0.5)
        order.append(item.payload["n"])

    assert Worker({queue.name: handle}, concurrency=2, burst=True).run() == 0
    assert order == [1, 0]


def test_a_consumer_started_from_async_code_runs_coroutines_that_use_the_orm(queue):
    """As Django's own Tasks tests start one: ``await sync_to_async(...)`` inside
    ``async_to_sync``. The handlers' ORM calls, the second one too (asgiref moves what it
    knows of the caller's context onto the loop's thread after the first), must not be
    sent to the thread that waits for the consumer."""
    queue.enqueue_many([{"n": n} for n in range(3)])

    async def handle(item):
        await Run.objects.acreate(item_id=item.pk, consumer=item.pid)
        return await Run.objects.filter(item_id=item.pk).acount()

    async def test_body():
        worker = Worker({queue.name: handle}, concurrency=3, burst=True)
        return await sync_to_async(worker.run)()

    codes = []
    caller = threading.Thread(target=lambda: codes.append(async_to_sync(test_body)()), daemon=True)
    caller.start()
    caller.join(timeout=30)
    assert not caller.is_alive(), "the consumer waited for its own caller's thread"
    assert codes == [0]
    assert [item.result for item in queue.items.filter(status=Status.DONE)] == [1, 1, 1]
