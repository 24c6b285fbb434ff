"""@handler("x", atomic=True): the handler's writes commit with the item's fenced
acknowledgement, or not at all. e2e/test_consumer_processes.py kills and stops real
consumers running such a handler; test_registry.py has the registration of atomic=True,
test_settle.py how the consumer counts what such a handler's transaction settled."""

import pytest

from django_txqueue import Queue, Status
from django_txqueue.consumer import registry
from django_txqueue.consumer.execution import run_atomic
from django_txqueue.models import QueueItem
from tests.helpers import expire
from tests.testapp.models import Run

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def atomic_queue(settings):
    settings.TXQUEUE = {**settings.TXQUEUE, "RETRY_DELAY": 60}
    registry.autodiscover()
    return Queue("atomic")


def effects(item):
    return list(Run.objects.filter(item_id=item.pk).values_list("consumer", flat=True))


class TestAtomicHandler:
    def test_its_writes_commit_with_the_acknowledgement(self, atomic_queue, run_consumer):
        item = atomic_queue.enqueue({"result": {"seat": 12}})
        run_consumer("atomic", "--burst")
        item.refresh_from_db()
        assert (item.status, item.attempts, item.result) == (Status.DONE, 1, {"seat": 12})
        assert effects(item) == [item.pid]

    def test_an_exception_rolls_its_writes_back_and_the_item_is_retried(
        self, atomic_queue, run_consumer
    ):
        item = atomic_queue.enqueue({"fail": True})
        run_consumer("atomic", "--burst")
        item.refresh_from_db()
        assert (item.status, item.attempts) == (Status.READY, 1)
        assert "the atomic handler failed" in item.last_error
        assert effects(item) == []

    def test_a_result_that_is_not_json_rolls_back_and_fails_the_item(
        self, atomic_queue, run_consumer, monkeypatch
    ):
        monkeypatch.setitem(registry._handlers, "atomic", not_json)
        item = atomic_queue.enqueue({})
        run_consumer("atomic", "--burst")
        item.refresh_from_db()
        assert (item.status, item.error_class) == (
            Status.FAILED,
            "django_txqueue.exceptions.NotJSONSerializable",
        )
        assert effects(item) == []

    def test_a_stale_claims_late_writes_are_rolled_back(self, atomic_queue):
        """The first claim's lease runs out, the item is rescued and claimed again; the
        first claim's handler, finishing late, is refused and leaves nothing behind."""
        atomic_queue.enqueue({})
        [stale] = atomic_queue.claim(pid="stale")
        expire(stale)
        assert atomic_queue.requeue_stuck() == 1
        [current] = atomic_queue.claim(pid="current")

        handle = registry.handlers()["atomic"]
        assert run_atomic(handle, stale) == ("recorded", False)
        assert effects(stale) == []
        assert QueueItem.objects.get(pk=stale.pk).status == Status.IN_PROGRESS

        assert run_atomic(handle, current) == ("recorded", True)
        assert effects(current) == ["current"]
        assert current.status == Status.DONE
        current.refresh_from_db()
        assert (current.status, current.pid, current.result) == (
            Status.DONE,
            "current",
            "recorded",
        )


def not_json(item):
    Run.objects.create(item_id=item.pk, consumer=item.pid)
    return {1, 2}
