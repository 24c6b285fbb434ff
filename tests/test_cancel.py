"""Cancellation: ``QueueItem.cancel()``, ``Queue.cancel()``, the queryset's, the
admin action and ``txqueue_cancel``; a READY item ends CANCELLED at once, a running one
gets a request that its handler polls (read with the lease renewal) and that settles it
CANCELLED on every path that settles an item; CANCELLED shown wherever a status is."""

import datetime as dt
import importlib
import io
import threading
import time

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_txqueue import Queue, QueueFull, Status, enqueue, store
from django_txqueue.consumer.worker import Worker
from django_txqueue.models import QueueItem
from django_txqueue.store import Ack
from django_txqueue.tasks.backend import TASKS_FRAMEWORK, ItemCancelled
from tests.helpers import FAST, expire, running, wait_for
from tests.test_admin import DASHBOARD, ITEMS, act, item_page, message, queue_rows, shown, staff
from tests.test_housekeeping import housekeeping
from tests.testapp.models import Thing

LONG = 600  # a lease no test outlives


def stored(item):
    return QueueItem.objects.get(pk=item.pk)


def claimed(queue, n=1, strategy="auto"):
    return queue.claim(n, pid="me", lease=LONG, strategy=strategy)


def request_cancel(item):
    """Cancel through a copy of the row, as another process would: the holder's instance
    does not learn of it until its consumer reads the requests."""
    assert stored(item).cancel() is True


# -- READY items ---------------------------------------------------------------------------


def test_a_ready_item_ends_cancelled_at_once(queue):
    item = queue.enqueue({"n": 1})
    assert item.cancel() is True
    assert item.status == Status.CANCELLED  # the instance, read back
    row = stored(item)
    assert row.status == Status.CANCELLED
    assert row.finished_at is not None
    assert queue.claim(1) == []  # never claimed
    assert queue.count(Status.READY) == 0


def test_a_cancelled_item_frees_its_dedup_key(queue):
    first = queue.enqueue({"n": 1}, dedup_key="report")
    assert queue.enqueue({"n": 2}, dedup_key="report").pk == first.pk  # held
    first.cancel()
    again = queue.enqueue({"n": 3}, dedup_key="report")
    assert again.pk != first.pk
    assert stored(first).active_dedup_key is None
    assert stored(again).active_dedup_key == "report"


def test_a_cancelled_item_leaves_room_under_max_size(queue, settings):
    settings.TXQUEUE = {**settings.TXQUEUE, "QUEUES": {queue.name: {"MAX_SIZE": 1}}}
    first = queue.enqueue({"n": 1})
    with pytest.raises(QueueFull):
        queue.enqueue({"n": 2})
    first.cancel()
    assert queue.enqueue({"n": 3}).pk != first.pk


@pytest.mark.parametrize("status", [Status.DONE, Status.FAILED, Status.CANCELLED])
def test_finished_items_are_left_alone(queue, status):
    item = queue.enqueue({})
    finished = timezone.now() - dt.timedelta(days=1)
    QueueItem.objects.filter(pk=item.pk).update(status=status, finished_at=finished)
    assert stored(item).cancel() is False
    row = stored(item)
    assert (row.status, row.finished_at, row.cancel_requested_at) == (status, finished, None)


# -- IN_PROGRESS items ---------------------------------------------------------------------


def test_a_running_item_gets_a_request_and_stays_in_progress(queue, strategy):
    queue.enqueue({})
    [item] = claimed(queue, strategy=strategy)
    copy = stored(item)
    assert copy.cancel() is True
    assert copy.cancel_requested() and copy.status == Status.IN_PROGRESS
    row = stored(item)
    assert row.status == Status.IN_PROGRESS and row.cancel_requested_at is not None
    assert row.claim_token == item.claim_token and row.finished_at is None
    assert copy.cancel() is False  # asked already: nothing new


def test_cancel_on_the_handlers_own_instance_is_seen_at_once(queue):
    queue.enqueue({})
    [item] = claimed(queue)
    assert not item.cancel_requested()
    item.cancel()
    assert item.cancel_requested()
    assert item.status == Status.IN_PROGRESS


def test_the_handler_learns_of_a_request_with_the_lease_renewal_not_per_call(
    queue, django_assert_num_queries
):
    queue.enqueue_many([{}, {}])
    asked, other = claimed(queue, 2)
    request_cancel(asked)
    with django_assert_num_queries(0):
        assert not asked.cancel_requested()  # polled as often as it likes: no query
    thread = housekeeping(queue.name, held=lambda: [(asked, None), (other, None)])
    with django_assert_num_queries(1):
        thread._read_cancel_requests()  # one read for every held item
    assert asked.cancel_requested() and not other.cancel_requested()
    with django_assert_num_queries(0):
        housekeeping(queue.name)._read_cancel_requests()  # nothing held, nothing read


def test_a_stale_claim_learns_nothing(queue):
    """The item was rescued and claimed again: the request is the new claim's, not the
    stale instance's."""
    queue.enqueue({})
    [stale] = claimed(queue)
    expire(stale)
    assert queue.requeue_stuck() == 1
    [current] = claimed(queue)
    request_cancel(current)
    housekeeping(queue.name, held=lambda: [(stale, None)])._read_cancel_requests()
    assert not stale.cancel_requested()


# -- settling a running item after the request ---------------------------------------------


@pytest.fixture
def asked(queue, strategy):
    """A claimed item whose cancellation was requested."""
    queue.enqueue({"n": 1})
    [item] = claimed(queue, strategy=strategy)
    request_cancel(item)
    return item


def assert_cancelled(item, attempts=1):
    row = stored(item)
    assert row.status == Status.CANCELLED
    assert row.finished_at is not None
    assert row.claim_token is None or row.lease_expires_at is None
    assert row.attempts == attempts
    return row


def test_an_acknowledgement_after_the_request_settles_it_cancelled(asked):
    assert asked.ack({"partial": True}) is True
    row = assert_cancelled(asked)
    assert row.result == {"partial": True}  # what it got to is kept


def test_a_batch_acknowledgement_settles_only_the_asked_ones_cancelled(queue, strategy):
    queue.enqueue_many([{}, {}])
    first, second = claimed(queue, 2, strategy=strategy)
    request_cancel(first)
    acked = store.ack_many(
        QueueItem, "default", Ack(first.claim_token, {first.pk: 1, second.pk: 2})
    )
    assert acked == 2
    assert_cancelled(first)
    assert stored(second).status == Status.DONE


def test_the_acknowledgement_riding_with_the_next_claim_settles_it_cancelled(queue, strategy):
    queue.enqueue_many([{}, {}, {}])
    first, second = claimed(queue, 2, strategy=strategy)
    request_cancel(first)
    results = {first.pk: None, second.pk: None}
    acked, more = queue.claims.ack_and_claim(
        Ack(first.claim_token, results), 1, pid="me", strategy=strategy
    )
    assert acked == 2 and len(more) == 1
    assert_cancelled(first)
    assert stored(second).status == Status.DONE


def test_a_retry_after_the_request_settles_it_cancelled_not_ready(asked):
    assert store.retry(asked, "it raised", delay=0) is True
    row = assert_cancelled(asked)
    assert row.last_error == "it raised"


def test_an_instance_that_knows_of_the_request_says_cancelled_after_settling(queue):
    queue.enqueue_many([{}, {}])
    first, second = claimed(queue, 2)
    first.cancel()
    second.cancel()
    assert first.ack() and first.status == Status.CANCELLED
    assert store.retry(second, "it raised", delay=0) and second.status == Status.CANCELLED
    assert stored(first).status == stored(second).status == Status.CANCELLED


def test_a_failure_after_the_request_settles_it_cancelled(asked):
    assert asked.fail("it raised") is True
    assert_cancelled(asked)


def test_a_release_after_the_request_settles_it_cancelled(asked):
    assert asked.release() is True
    assert_cancelled(asked, attempts=0)  # a release counts no attempt


def test_a_rescue_after_the_request_settles_it_cancelled(asked, queue):
    expire(asked)
    assert queue.requeue_stuck() == 1
    row = assert_cancelled(asked)
    assert row.last_error == ""


def test_a_rescue_that_fails_stuck_items_still_cancels_the_asked_one(asked, queue):
    expire(asked)
    assert queue.items.requeue_stuck(fail=True) == 1
    assert_cancelled(asked)


def test_without_a_request_every_path_settles_as_before(queue, strategy):
    queue.enqueue_many([{}] * 4)
    acked, retried, released, rescued = claimed(queue, 4, strategy=strategy)
    acked.ack()
    store.retry(retried, "again", delay=0)
    released.release()
    expire(rescued)
    queue.requeue_stuck()
    assert stored(acked).status == Status.DONE
    assert [stored(i).status for i in (retried, released, rescued)] == [Status.READY] * 3


def test_requeueing_a_stuck_asked_item_drops_the_request(asked, queue):
    expire(asked)
    QueueItem.objects.filter(pk=asked.pk).update(status=Status.FAILED)  # failed by hand
    assert QueueItem.objects.filter(pk=asked.pk).requeue() == 1
    row = stored(asked)
    assert row.status == Status.READY and row.cancel_requested_at is None


def test_a_plain_queue_model_without_the_column_settles_as_before(db, strategy):
    Thing.objects.bulk_create([Thing(name=str(n)) for n in range(4)])
    acked, failed, released, rescued = Thing.objects.claim(
        4, pid="me", lease=LONG, strategy=strategy
    )
    assert acked.ack() and failed.fail() and released.release()
    Thing.objects.filter(pk=rescued.pk).update(lease_expires_at=timezone.now())
    time.sleep(0.01)
    assert Thing.objects.requeue_stuck() == 1
    statuses = dict(Thing.objects.values_list("pk", "status"))
    assert statuses[acked.pk] == Status.DONE and statuses[failed.pk] == Status.FAILED
    assert statuses[released.pk] == statuses[rescued.pk] == Status.READY


# -- Queue.cancel and the queryset ---------------------------------------------------------


def test_queue_cancel_of_everything_unfinished_in_one_update(
    queue, strategy, django_assert_num_queries
):
    other = Queue(f"{queue.name}-other")
    spared = other.enqueue({})
    queue.enqueue_many([{}] * 4)
    done, running_ = claimed(queue, 2, strategy=strategy)
    done.ack()
    # The UPDATE, and one look for items a flow waits for (none here: docs/flows.md).
    with django_assert_num_queries(2):
        assert queue.cancel() == 3  # two READY, one running
    assert queue.count(Status.CANCELLED) == 2
    assert stored(running_).cancel_requested_at is not None
    assert stored(done).status == Status.DONE
    assert stored(spared).status == Status.READY


def test_queue_cancel_of_a_queryset_touches_only_its_own_queue(queue):
    mine = queue.enqueue_many([{}, {}, {}])
    theirs = enqueue(f"{queue.name}-other", {})
    chosen = QueueItem.objects.filter(pk__in=[mine[0].pk, mine[1].pk, theirs.pk])
    assert queue.cancel(chosen) == 2
    assert [stored(item).status for item in mine] == [
        Status.CANCELLED,
        Status.CANCELLED,
        Status.READY,
    ]
    assert stored(theirs).status == Status.READY


def test_queue_cancel_takes_querysets_of_queue_items_only(queue):
    with pytest.raises(TypeError):
        queue.cancel(Thing.objects.all())


def test_the_queryset_cancels_in_one_update(queue, django_assert_num_queries):
    items = queue.enqueue_many([{}] * 3)
    with django_assert_num_queries(2):  # and the look for a flow's items, as above
        assert QueueItem.objects.filter(pk__in=[i.pk for i in items[:2]]).cancel() == 2
    assert queue.count(Status.CANCELLED) == 2


# -- a real consumer -----------------------------------------------------------------------

consumed = pytest.mark.django_db(transaction=True)


class Handlers:
    """Handlers that say when they started, and how they end."""

    def __init__(self):
        self.started = threading.Event()
        self.go = threading.Event()
        self.saw_request = False

    def polite(self, item):
        """Polls the request, as a long handler should, and stops when asked."""
        self.started.set()
        deadline = time.monotonic() + 10
        while not item.cancel_requested():
            if time.monotonic() > deadline:
                return "never asked"
            time.sleep(0.01)
        self.saw_request = True
        return "stopped early"

    def raises(self, item):
        self.started.set()
        wait_for(item.cancel_requested, timeout=10)
        raise RuntimeError("interrupted")

    def deaf(self, item):
        """Never polls: works on until the test lets it go."""
        self.started.set()
        self.go.wait(10)
        return "finished anyway"


def worker(name, handle, strategy):
    return Worker(handlers={name: handle}, strategy=strategy, batch=1)


@consumed
@pytest.mark.usefixtures("fast_consumers")
class TestUnderAConsumer:
    def test_a_handler_that_polls_and_returns_ends_cancelled(self, strategy):
        handlers = Handlers()
        item = enqueue("cancel-polite", {})
        with running(worker("cancel-polite", handlers.polite, strategy)):
            assert handlers.started.wait(10)
            assert stored(item).cancel() is True
            assert wait_for(lambda: stored(item).status == Status.CANCELLED)
        assert handlers.saw_request
        row = stored(item)
        assert row.result == "stopped early" and row.attempts == 1

    def test_a_handler_that_raises_after_the_request_ends_cancelled_not_retried(self, strategy):
        handlers = Handlers()
        item = enqueue("cancel-raises", {}, max_attempts=5)
        with running(worker("cancel-raises", handlers.raises, strategy)):
            assert handlers.started.wait(10)
            Queue("cancel-raises").cancel()
            assert wait_for(lambda: stored(item).status == Status.CANCELLED)
            time.sleep(0.2)  # a retry would claim it again by now
        row = stored(item)
        assert row.status == Status.CANCELLED and row.attempts == 1
        assert "interrupted" in row.last_error

    def test_a_handler_that_ignores_the_request_still_ends_cancelled(self, strategy):
        """It returned after the request: the request decides, polled or not (README)."""
        handlers = Handlers()
        item = enqueue("cancel-deaf", {})
        with running(worker("cancel-deaf", handlers.deaf, strategy)):
            assert handlers.started.wait(10)
            stored(item).cancel()
            handlers.go.set()
            assert wait_for(lambda: stored(item).status == Status.CANCELLED)
        assert stored(item).result == "finished anyway"

    def test_a_handler_that_succeeds_before_the_request_ends_done(self, strategy):
        handlers = Handlers()
        handlers.go.set()
        item = enqueue("cancel-deaf", {})
        with running(worker("cancel-deaf", handlers.deaf, strategy)):
            assert wait_for(lambda: stored(item).status == Status.DONE)
            assert stored(item).cancel() is False
        assert stored(item).status == Status.DONE

    def test_cancelled_ready_items_are_never_claimed(self, strategy):
        ran = []
        queue = Queue("cancel-ready")
        kept, dropped = queue.enqueue_many([{"n": 1}, {"n": 2}])
        dropped.cancel()
        with running(worker("cancel-ready", lambda item: ran.append(item.pk), strategy)):
            assert wait_for(lambda: stored(kept).status == Status.DONE)
            time.sleep(0.2)
        assert ran == [kept.pk]
        assert stored(dropped).status == Status.CANCELLED


def test_fast_consumers_poll_the_requests_often(settings):
    """The housekeeping tick (HEARTBEAT_INTERVAL, or a third of the shortest lease) is what
    the consumer tests above rely on to see a request quickly."""
    settings.TXQUEUE = {**settings.TXQUEUE, **FAST}
    assert housekeeping("a")._tick() <= 0.1


# -- purge ---------------------------------------------------------------------------------


def test_cancelled_items_are_purged_like_done(queue):
    done, cancelled, ready = queue.enqueue_many([{}, {}, {}])
    QueueItem.objects.filter(pk=done.pk).update(status=Status.DONE, finished_at=timezone.now())
    cancelled.cancel()
    QueueItem.objects.filter(pk__in=[done.pk, cancelled.pk]).update(
        finished_at=timezone.now() - dt.timedelta(days=2)
    )
    assert queue.purge(older_than=dt.timedelta(days=1)) == 2
    assert list(queue.items.values_list("pk", flat=True)) == [ready.pk]


def test_cancelled_items_are_deleted_as_finished(queue):
    ready, cancelled = queue.enqueue_many([{}, {}])
    cancelled.cancel()
    assert queue.items.delete_finished() == 1
    assert list(queue.items.values_list("pk", flat=True)) == [ready.pk]


# -- where a status is shown ---------------------------------------------------------------


def test_stats_count_the_cancelled_items(queue):
    queue.enqueue_many([{}] * 3)[0].cancel()
    stats = queue.stats()
    assert (stats["cancelled"], stats["ready"]) == (1, 2)


class TestAdmin:
    @pytest.fixture
    def items(self, db):
        ready = enqueue("alpha", {})
        queued = enqueue("alpha", {})
        [running_] = Queue("alpha").claim(1, pid="someone", lease=LONG)
        assert running_.pk == ready.pk
        return queued, running_

    def test_the_cancel_action_with_the_change_permission(self, admin_client, items):
        queued, running_ = items
        response = act(admin_client, "cancel", [queued, running_])
        assert "Cancelled 2 of 2 selected items" in message(response)
        assert stored(queued).status == Status.CANCELLED
        assert stored(running_).cancel_requested_at is not None
        assert "left alone (1 already finished" in message(act(admin_client, "cancel", [queued]))

    def test_no_cancel_action_without_the_change_permission(self, client, items):
        client.force_login(staff("viewer", "view_queueitem"))
        page = client.get(ITEMS).content.decode()
        assert 'value="cancel"' not in page
        act(client, "cancel", list(items))
        assert stored(items[0]).status == Status.READY
        assert stored(items[1]).cancel_requested_at is None

    def test_cancel_action_offered_with_the_change_permission(self, client, items):
        client.force_login(staff("changer", "view_queueitem", "change_queueitem"))
        assert 'value="cancel"' in client.get(ITEMS).content.decode()
        act(client, "cancel", [items[0]])
        assert stored(items[0]).status == Status.CANCELLED

    def test_the_status_filter_list_and_change_page_show_cancelled(self, admin_client, items):
        queued, _ = items
        queued.cancel()
        page = admin_client.get(ITEMS).content.decode()
        assert "status__exact=5" in page  # the filter's choice
        assert shown(admin_client.get(ITEMS, {"status__exact": "5"})) == {queued.pk}
        assert "cancelled" in admin_client.get(item_page(queued)).content.decode()

    def test_the_dashboard_counts_cancelled_items(self, admin_client, items):
        items[0].cancel()
        rows = queue_rows(admin_client.get(DASHBOARD))
        assert rows["alpha"].cancelled == 1
        assert rows["alpha"].failed == 0
        assert 'data-column="cancelled"' in admin_client.get(DASHBOARD).content.decode()


# -- the command ---------------------------------------------------------------------------


def run(*args):
    out = io.StringIO()
    call_command("txqueue_cancel", *args, stdout=out, no_color=True)
    return out.getvalue()


def test_the_command_cancels_the_items_named(queue):
    first, second, third = queue.enqueue_many([{}, {}, {}])
    theirs = enqueue(f"{queue.name}-other", {})
    out = run(queue.name, "--id", str(first.pk), str(theirs.pk), "--id", str(third.pk))
    assert "Cancelled 2 items" in out
    statuses = [stored(item).status for item in (first, second, third, theirs)]
    assert statuses == [Status.CANCELLED, Status.READY, Status.CANCELLED, Status.READY]


def test_the_command_cancels_a_whole_queue_only_when_told(queue):
    queue.enqueue_many([{}, {}])
    with pytest.raises(CommandError):
        run(queue.name)
    assert queue.count(Status.READY) == 2
    assert "Cancelled 2 items" in run(queue.name, "--all")
    assert queue.count(Status.CANCELLED) == 2


def test_the_command_takes_ids_or_all_not_both(queue):
    with pytest.raises(CommandError):
        run(queue.name, "--all", "--id", "1")


def test_the_command_refuses_a_bad_queue_name(db):
    with pytest.raises(CommandError):
        run("no spaces allowed" * 20, "--all")


# -- the Django Tasks backend --------------------------------------------------------------


@pytest.mark.skipif(TASKS_FRAMEWORK is None, reason="no Tasks framework")
def test_the_tasks_backend_reports_a_cancelled_item_failed(db):
    from tests.testapp import tasks

    framework = importlib.import_module(TASKS_FRAMEWORK)
    result = tasks.add.enqueue(2, 3)
    QueueItem.objects.get(pk=int(result.id)).cancel()
    fetched = tasks.add.get_result(result.id)
    assert fetched.status == framework.TaskResultStatus.FAILED
    assert fetched.finished_at is not None
    [error] = fetched.errors
    assert error.exception_class_path.endswith(ItemCancelled.__qualname__)


def test_no_per_call_query_in_the_claim_of_a_queue_that_never_cancels(queue):
    """The claim reads no cancellation column it did not read before: the whole row, one
    statement, as ever."""
    queue.enqueue({})
    with CaptureQueriesContext(connection) as queries:
        queue.claim(1)
    assert not any("cancel_requested_at IS" in q["sql"] for q in queries.captured_queries)
