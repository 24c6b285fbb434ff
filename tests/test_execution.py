"""consumer/execution.py: one handler run and what it came to. A failure is the item's, never the
consumer's; test_atomic_handlers.py covers the atomic handler's transaction in depth."""

import pytest
from django.db import connection

from django_txqueue import Queue, Status
from django_txqueue.consumer import registry
from django_txqueue.consumer.execution import Outcome, run_handler
from django_txqueue.consumer.settle import Settler
from django_txqueue.models import QueueItem
from tests.helpers import lose_connection
from tests.testapp.models import Run


@pytest.fixture
def claimed(queue):
    queue.enqueue({"n": 1})
    [item] = queue.claim(1)
    return item


def test_a_success_carries_the_result_and_how_long_it_took(claimed):
    outcome = run_handler(lambda item: {"doubled": item.payload["n"] * 2}, claimed)
    assert (outcome.item, outcome.result, outcome.error) == (claimed, {"doubled": 2}, None)
    assert outcome.duration >= 0
    assert outcome.acknowledged is None  # the settler acknowledges it
    assert QueueItem.objects.get(pk=claimed.pk).status == Status.IN_PROGRESS


def test_an_exception_is_the_items_failure_with_its_traceback(claimed):
    def boom(item):
        raise LookupError("no such seat")

    outcome = run_handler(boom, claimed)
    assert outcome.error_class == "builtins.LookupError"
    assert "Traceback" in outcome.error and "no such seat" in outcome.error
    assert outcome.retry  # a retry with back-off, until the attempts are spent


@pytest.mark.parametrize("exit_with", [SystemExit(3), KeyboardInterrupt()])
def test_exiting_from_a_handler_fails_the_item_and_not_the_consumer(claimed, exit_with):
    def exits(item):
        raise exit_with

    outcome = run_handler(exits, claimed)
    assert outcome.error_class == f"builtins.{type(exit_with).__name__}"


def test_a_result_json_cannot_hold_fails_at_once(claimed):
    outcome = run_handler(lambda item: {1, 2}, claimed)
    assert outcome.error_class == "django_txqueue.exceptions.NotJSONSerializable"
    assert "set" in outcome.error
    assert outcome.retry is False  # running it again would return the same


@pytest.mark.django_db(transaction=True)
def test_an_atomic_handler_is_acknowledged_in_its_own_transaction():
    registry.handler("execution-atomic", atomic=True)(lambda item: "kept")
    try:
        Queue("execution-atomic").enqueue({})
        [item] = Queue("execution-atomic").claim(1)
        outcome = run_handler(registry.handlers()["execution-atomic"], item)
    finally:
        registry.unregister("execution-atomic")
    assert (outcome.result, outcome.acknowledged) == ("kept", True)
    stored = QueueItem.objects.get(pk=item.pk)
    assert (stored.status, stored.result) == (Status.DONE, "kept")


def test_outcome_failed_records_the_class_path_and_whether_to_retry(claimed):
    outcome = Outcome(claimed)
    outcome.failed(ValueError("bad"), retry=False)
    assert (outcome.error_class, outcome.retry) == ("builtins.ValueError", False)
    assert outcome.error.rstrip().endswith("ValueError: bad")


@pytest.mark.django_db(transaction=True)
@pytest.mark.requires("lost_connections")
def test_an_atomic_handler_whose_connection_is_lost_is_the_databases_failure():
    """Its writes roll back with the lost transaction, the connection is dropped for
    Django to reconnect, and the outcome is ``lost``: the item is released, not failed."""

    def loses_its_connection(item):
        Run.objects.create(item_id=item.pk, consumer="lost")
        lose_connection()  # the server drops it mid-transaction, as at a failover
        Run.objects.create(item_id=item.pk, consumer="lost")

    registry.handler("execution-lost", atomic=True)(loses_its_connection)
    try:
        Queue("execution-lost").enqueue({})
        [item] = Queue("execution-lost").claim(1)
        outcome = run_handler(registry.handlers()["execution-lost"], item)
    finally:
        registry.unregister("execution-lost")
    assert outcome.lost and outcome.error is not None and outcome.acknowledged is None
    assert not Run.objects.filter(item_id=item.pk).exists()  # reconnected, rolled back
    settler = Settler("default")
    settler.settle([outcome])
    stored = QueueItem.objects.get(pk=item.pk)
    assert (stored.status, stored.attempts) == (Status.READY, 0)


def test_a_handlers_own_database_error_is_its_failure(claimed):
    def bad_query(item):
        with connection.cursor() as cursor:
            cursor.execute("SELECT no_such_column FROM django_txqueue_queueitem")

    outcome = run_handler(bad_query, claimed)
    assert outcome.error is not None and not outcome.lost
