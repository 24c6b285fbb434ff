"""The Django Tasks backend: Task <-> QueueItem, run by the real consumer.

TASKS in tests/settings.py selects TxQueueBackend with the queues "default" and
"tasks-other"; the tasks are in tests/testapp/tasks.py. Tasks run through
``run_queue_consumer --burst`` with no queue names (every handler queue plus the Tasks
queues), in this process: its handler threads use their own connections, hence the
committed database (``transaction=True``) for those tests.
"""

import importlib
import importlib.util
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.core import checks as django_checks
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from django_txqueue import Queue, Status, enqueue, store
from django_txqueue import signals as signals_txqueue
from django_txqueue.consumer.registry import handlers
from django_txqueue.consumer.worker import Worker
from django_txqueue.management.commands import run_queue_consumer
from django_txqueue.models import Consumer, QueueItem
from django_txqueue.tasks import backend as txbackends
from django_txqueue.tasks.backend import (
    TASKS_FRAMEWORK,
    ItemFailed,
    TxQueueBackend,
    any_task_queue,
    find_task_queue,
    run_task,
    task_handlers,
)

from .helpers import ROOT, child_env, expire, wait_for

needs_tasks = pytest.mark.skipif(
    TASKS_FRAMEWORK is None,
    reason="no Tasks framework: Django < 6.0 without the django-tasks backport",
)
# The consumer's handler threads see only committed rows.
consumed = pytest.mark.django_db(transaction=True)

if TASKS_FRAMEWORK is not None:
    from tests.testapp import tasks

    framework = importlib.import_module(TASKS_FRAMEWORK)
    TaskResultStatus = framework.TaskResultStatus
    exceptions = importlib.import_module(f"{TASKS_FRAMEWORK}.exceptions")
    signals = importlib.import_module(f"{TASKS_FRAMEWORK}.signals")

ITEM_FAILED = f"{ItemFailed.__module__}.{ItemFailed.__qualname__}"


@pytest.fixture
def run_once(settings):
    """Django's run-once semantics for the Tasks queues: MAX_ATTEMPTS 1 (README)."""
    once = {"MAX_ATTEMPTS": 1}
    settings.TXQUEUE = {**settings.TXQUEUE, "QUEUES": {"default": once, "tasks-other": once}}


@pytest.fixture
def fast_retries(settings):
    """Retries due (almost) at once, so that a few burst runs spend every attempt."""
    settings.TXQUEUE = {**settings.TXQUEUE, "RETRY_DELAY": 0.001, "RETRY_MAX_DELAY": 0.001}


def claim_one(queue="default"):
    claimed = Queue(queue).claim()
    assert len(claimed) == 1
    return claimed[0]


def item_of(result):
    return QueueItem.objects.get(pk=int(result.id))


# -- enqueue -------------------------------------------------------------------------


@needs_tasks
def test_enqueue_stores_one_item_on_the_tasks_queue(db):
    result = tasks.add.enqueue(2, 3)

    item = item_of(result)
    assert result.id == str(item.pk)
    assert item.queue == "default"
    assert item.status == Status.READY
    assert item.priority == 0
    assert item.payload == {
        "task": "tests.testapp.tasks.add",
        "args": [2, 3],
        "kwargs": {},
        "backend": "default",
        "takes_context": False,
        "run_after": None,
    }
    assert result.status == TaskResultStatus.READY
    assert result.task is tasks.add
    assert result.backend == "default"
    assert result.args == [2, 3]
    assert result.kwargs == {}
    assert result.enqueued_at == item.created_at
    assert result.started_at is None
    assert result.finished_at is None
    assert result.last_attempted_at is None
    assert result.errors == []
    assert result.worker_ids == []
    assert result.attempts == 0
    assert not result.is_finished
    with pytest.raises(ValueError, match="not finished"):
        _ = result.return_value


@needs_tasks
def test_queue_name_and_priority_map_to_the_item(db):
    urgent = tasks.shout.enqueue("hi", times=2)  # @task(priority=10, queue_name="tasks-other")
    item = item_of(urgent)
    assert item.queue == "tasks-other"
    assert item.priority == -10
    assert item.payload["kwargs"] == {"times": 2}

    assert item_of(tasks.add.using(priority=-100).enqueue(1, 1)).priority == 100
    assert item_of(tasks.add.using(priority=100).enqueue(1, 1)).priority == -100
    moved = tasks.add.using(queue_name="tasks-other").enqueue(1, 1)
    assert item_of(moved).queue == "tasks-other"
    assert tasks.add.get_result(moved.id).task.queue_name == "tasks-other"


@needs_tasks
def test_higher_task_priority_is_claimed_first(db):
    low = tasks.add.using(priority=-5).enqueue(1, 0)
    normal = tasks.add.enqueue(2, 0)
    high = tasks.add.using(priority=50).enqueue(3, 0)

    order = [str(item.pk) for item in Queue("default").claim(3)]
    assert order == [high.id, normal.id, low.id]
    assert tasks.add.get_result(high.id).task.priority == 50


@needs_tasks
def test_run_after_is_the_items_run_at(db):
    when = timezone.now() + timedelta(hours=1)
    result = tasks.add.using(run_after=when).enqueue(1, 2)

    item = item_of(result)
    assert item.run_at == when
    assert item.payload["run_after"] == when.isoformat()
    assert Queue("default").claim() == []  # not due yet
    assert tasks.add.get_result(result.id).task.run_after == when


@needs_tasks
def test_non_json_argument_is_a_type_error_and_writes_nothing(db):
    with pytest.raises(TypeError, match="arguments of task tests.testapp.tasks.add"):
        tasks.add.enqueue(object(), 1)
    with pytest.raises(TypeError, match="keyword arguments"):
        tasks.shout.enqueue("x", times={1, 2})
    with pytest.raises(TypeError, match="Object of type datetime is not JSON serializable"):
        tasks.add.enqueue(timezone.now(), 1)  # Django Tasks keep plain JSON types only
    assert QueueItem.objects.count() == 0


@needs_tasks
def test_non_json_argument_keeps_djangos_message_then_names_the_task(db):
    with pytest.raises(TypeError) as raised:
        tasks.add.enqueue(timezone.now(), 1)
    # Django's own backends raise "Unsupported type: ..." (django.utils.json.normalize_json).
    assert str(raised.value).startswith(
        "Unsupported type: <class 'datetime.datetime'>, "
        "in the arguments of task tests.testapp.tasks.add"
    )
    with pytest.raises(ValueError, match=r"^Unsupported value: .*keyword arguments of task"):
        tasks.shout.enqueue("x", times=b"\xff")  # bytes not UTF-8: Django's ValueError
    assert QueueItem.objects.count() == 0


@needs_tasks
def test_arguments_are_normalised_like_django_tasks(db):
    result = tasks.add.enqueue((1, 2), {"a": (3,)})
    assert item_of(result).payload["args"] == [[1, 2], {"a": [3]}]
    assert result.args == [[1, 2], {"a": [3]}]


@needs_tasks
def test_enqueue_joins_the_callers_transaction(db):
    with pytest.raises(RuntimeError), transaction.atomic():
        tasks.add.enqueue(1, 2)
        assert QueueItem.objects.count() == 1
        raise RuntimeError("roll back")
    assert QueueItem.objects.count() == 0

    with transaction.atomic():
        kept = tasks.add.enqueue(1, 2)
    assert item_of(kept).status == Status.READY


@needs_tasks
def test_aenqueue_and_aget_result(db):
    result = async_to_sync(tasks.add.aenqueue)(4, 5)
    assert item_of(result).payload["args"] == [4, 5]
    again = async_to_sync(tasks.add.aget_result)(result.id)
    assert again.status == TaskResultStatus.READY
    assert again.args == [4, 5]


# -- running and results -------------------------------------------------------------


@needs_tasks
def test_running_item_shows_running(db):
    result = tasks.add.enqueue(2, 3)
    item = claim_one()

    running = tasks.add.get_result(result.id)
    assert running.status == TaskResultStatus.RUNNING
    assert running.started_at == item.claimed_at
    assert running.last_attempted_at == item.claimed_at
    assert running.finished_at is None
    assert running.worker_ids == [item.pid]
    assert running.attempts == 1


@needs_tasks
@consumed
def test_successful_task_shows_its_return_value(run_consumer):
    result = tasks.add.enqueue(2, 3)

    run_consumer("--burst")

    item = item_of(result)
    assert item.status == Status.DONE
    assert item.result == 5
    consumer = Consumer.objects.get()
    assert consumer.os_pid == os.getpid() and consumer.stopped_at is not None

    done = tasks.add.get_result(result.id)
    assert done.status == TaskResultStatus.SUCCESSFUL
    assert done.return_value == 5
    assert done.is_finished
    assert done.finished_at == item.finished_at
    assert done.started_at == item.claimed_at
    assert done.last_attempted_at == item.claimed_at
    assert done.enqueued_at == item.created_at
    assert done.enqueued_at <= done.started_at <= done.finished_at
    assert done.errors == []
    assert done.worker_ids == [consumer.identity]
    assert done.attempts == 1

    result.refresh()  # the result enqueue returned reads the item again
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == 5


@needs_tasks
@consumed
def test_failed_task_shows_its_exception_class_and_traceback(run_consumer, run_once):
    result = tasks.boom.enqueue("it broke")

    run_consumer("--burst")

    item = item_of(result)
    assert (item.status, item.attempts) == (Status.FAILED, 1)
    assert item.error_class == "tests.testapp.tasks.TaskBoom"  # written by the consumer

    failed = tasks.boom.get_result(result.id)
    assert failed.status == TaskResultStatus.FAILED
    assert failed.is_finished
    assert failed.finished_at == item.finished_at
    assert failed.worker_ids == [Consumer.objects.get().identity]
    assert len(failed.errors) == 1
    error = failed.errors[0]
    assert error.exception_class_path == "tests.testapp.tasks.TaskBoom"
    assert error.exception_class is tasks.TaskBoom
    assert error.traceback == item.last_error
    assert error.traceback.startswith("Traceback (most recent call last):")
    assert "tests.testapp.tasks.TaskBoom: it broke" in error.traceback
    with pytest.raises(ValueError, match="Task failed"):
        _ = failed.return_value


@needs_tasks
@consumed
def test_builtin_exception_is_named_in_builtins(run_consumer, run_once):
    result = tasks.builtin_boom.enqueue()
    run_consumer("--burst")

    assert item_of(result).error_class == "builtins.ValueError"
    error = tasks.builtin_boom.get_result(result.id).errors[0]
    assert error.exception_class_path == "builtins.ValueError"
    assert error.exception_class is ValueError
    assert "ValueError: bad value" in error.traceback


@needs_tasks
@consumed
def test_a_task_that_snoozes_is_ready_again_and_not_finished(run_consumer):
    finished = []

    def record(sender, task_result, **kwargs):
        finished.append(task_result.status)

    signals.task_finished.connect(record, dispatch_uid="snooze-test")
    try:
        result = tasks.not_yet.enqueue()
        run_consumer("--burst")
    finally:
        signals.task_finished.disconnect(dispatch_uid="snooze-test")
    item = item_of(result)
    assert (item.status, item.attempts, item.snoozes) == (Status.READY, 0, 1)
    assert tasks.not_yet.get_result(result.id).status == TaskResultStatus.READY
    assert finished == []


@needs_tasks
@consumed
def test_a_task_reports_progress_through_its_item(run_consumer):
    result = tasks.reports_progress.enqueue(steps=3)
    run_consumer("--burst")
    assert tasks.reports_progress.get_result(result.id).return_value == "reported"
    # The last report, held back by the once-a-second limit, written by the task itself.
    assert item_of(result).progress == {"done": 3, "total": 3, "message": "working"}


@needs_tasks
@consumed
def test_retried_task_is_ready_again_with_the_attempts_error(run_consumer):
    result = tasks.builtin_boom.enqueue()  # RETRY_DELAY is 10 s: not due again in this run

    run_consumer("--burst")

    again = tasks.builtin_boom.get_result(result.id)
    assert again.status == TaskResultStatus.READY
    assert [error.exception_class_path for error in again.errors] == ["builtins.ValueError"]
    assert again.attempts == 1
    assert again.worker_ids == [""]  # the queue forgets a retried attempt's consumer
    assert again.finished_at is None
    item = item_of(result)
    assert (item.status, item.error_class) == (Status.READY, "builtins.ValueError")
    assert item.run_at > item.claimed_at


@needs_tasks
@consumed
def test_a_failing_task_is_retried_until_max_attempts_each_error_the_latest(
    run_consumer, fast_retries
):
    result = tasks.fails_every_attempt.enqueue()
    max_attempts = item_of(result).max_attempts
    assert max_attempts == 5  # the default MAX_ATTEMPTS
    seen = []

    def record(sender, item, will_retry, **kwargs):
        # Settled on the consumer's main thread (this one): read back what the attempt left.
        now = tasks.fails_every_attempt.get_result(str(item.pk))
        seen.append((now.attempts, str(now.status), will_retry, now.errors))

    signals_txqueue.item_failed.connect(record)
    try:
        for _ in range(100):  # a burst run stops when the retry is not due yet
            run_consumer("--burst")
            if item_of(result).status == Status.FAILED:
                break
            time.sleep(0.005)
    finally:
        signals_txqueue.item_failed.disconnect(record)

    assert [(attempt, status, retry) for attempt, status, retry, _ in seen] == [
        *((n, "READY", True) for n in range(1, max_attempts)),
        (max_attempts, "FAILED", False),
    ]
    for attempt, _, _, errors in seen:
        assert len(errors) == 1  # only the latest attempt's error
        assert errors[0].exception_class_path == "tests.testapp.tasks.TaskBoom"
        assert errors[0].traceback.rstrip().endswith(f"TaskBoom: attempt {attempt}")

    failed = tasks.fails_every_attempt.get_result(result.id)
    assert failed.status == TaskResultStatus.FAILED
    assert failed.attempts == max_attempts == item_of(result).attempts
    assert [error.exception_class_path for error in failed.errors] == [
        "tests.testapp.tasks.TaskBoom"
    ]
    assert f"TaskBoom: attempt {max_attempts}" in failed.errors[0].traceback
    assert f"attempt {max_attempts - 1}" not in failed.errors[0].traceback
    assert failed.worker_ids[:-1] == [""] * (max_attempts - 1)
    assert failed.worker_ids[-1] in set(Consumer.objects.values_list("identity", flat=True))


@needs_tasks
@consumed
def test_queue_max_attempts_applies_to_tasks(run_consumer, fast_retries, settings):
    settings.TXQUEUE = {**settings.TXQUEUE, "QUEUES": {"default": {"MAX_ATTEMPTS": 2}}}
    result = tasks.fails_every_attempt.enqueue()
    for _ in range(100):
        run_consumer("--burst")
        if item_of(result).status == Status.FAILED:
            break
        time.sleep(0.005)
    failed = tasks.fails_every_attempt.get_result(result.id)
    assert (failed.status, failed.attempts) == (TaskResultStatus.FAILED, 2)
    assert "TaskBoom: attempt 2" in failed.errors[0].traceback


@needs_tasks
def test_failure_without_traceback_names_item_failed(db):
    result = tasks.add.enqueue(1, 1)
    item = claim_one()
    assert item.fail("stuck: lease expired or consumer died")

    failed = tasks.add.get_result(result.id)
    assert failed.status == TaskResultStatus.FAILED
    assert failed.errors[0].exception_class_path == ITEM_FAILED
    assert failed.errors[0].exception_class is ItemFailed
    assert failed.errors[0].traceback == "stuck: lease expired or consumer died"


@needs_tasks
def test_store_fail_without_an_error_class_names_item_failed(db):
    with_error = tasks.add.enqueue(1, 1)
    assert store.fail(claim_one(), "given up by hand")
    without_error = tasks.add.enqueue(2, 2)
    assert store.fail(claim_one())

    failed = tasks.add.get_result(with_error.id)
    assert failed.status == TaskResultStatus.FAILED
    assert [(e.exception_class_path, e.traceback) for e in failed.errors] == [
        (ITEM_FAILED, "given up by hand")
    ]
    failed = tasks.add.get_result(without_error.id)
    assert failed.status == TaskResultStatus.FAILED
    assert [(e.exception_class_path, e.traceback) for e in failed.errors] == [(ITEM_FAILED, "")]
    assert failed.errors[0].exception_class is ItemFailed


@needs_tasks
def test_a_rescue_failure_names_item_failed_not_an_earlier_attempts_class(db):
    result = tasks.builtin_boom.using(queue_name="tasks-other").enqueue()
    item = claim_one("tasks-other")
    assert store.retry(item, "Traceback ...", delay=0, error_class="builtins.ValueError")
    QueueItem.objects.filter(pk=item.pk).update(attempts=F("max_attempts") - 1)
    expire(claim_one("tasks-other"))  # its consumer hung on the last attempt

    assert Queue("tasks-other").requeue_stuck() == 1

    failed = tasks.builtin_boom.get_result(result.id)
    assert failed.status == TaskResultStatus.FAILED
    assert failed.errors[0].exception_class_path == ITEM_FAILED
    assert failed.errors[0].traceback.startswith("stuck")


@needs_tasks
@consumed
def test_task_with_context_gets_its_result_and_attempt(run_consumer):
    result = tasks.attempt_info.enqueue(7)
    assert item_of(result).payload["takes_context"] is True

    run_consumer("--burst")

    done = tasks.attempt_info.get_result(result.id)
    assert done.status == TaskResultStatus.SUCCESSFUL
    assert done.return_value == {"attempt": 1, "id": result.id, "x": 7}


@needs_tasks
@consumed
def test_context_attempt_counts_the_consumers_attempts(run_consumer, fast_retries):
    result = tasks.flaky.enqueue()
    for _ in range(100):
        run_consumer("--burst")
        if item_of(result).status != Status.READY:
            break
        time.sleep(0.005)
    done = tasks.flaky.get_result(result.id)
    assert (done.status, done.attempts) == (TaskResultStatus.SUCCESSFUL, 2)
    value: Any = done.return_value
    assert value == 2  # context.attempt on the second attempt
    assert done.errors[0].exception_class_path == "tests.testapp.tasks.TaskBoom"  # the first's


@needs_tasks
@consumed
def test_async_tasks_run_side_by_side_on_the_event_loop_and_sync_ones_on_threads():
    naps = [tasks.async_nap.enqueue(0.3) for _ in range(10)]
    sync = tasks.where.enqueue()
    began = time.monotonic()
    assert Worker({"default": run_task}, concurrency=10, burst=True).run() == 0
    assert time.monotonic() - began < 2.5  # one after another: 3 s
    assert {tasks.async_nap.get_result(r.id).return_value for r in naps} == {"txqueue-event-loop"}
    assert tasks.where.get_result(sync.id).return_value.startswith("txqueue-handler-")


@needs_tasks
def test_aenqueue_and_aget_result_do_their_queries_off_the_event_loop(db, monkeypatch):
    queries_on = []
    enqueue, get_result = TxQueueBackend.enqueue, TxQueueBackend.get_result

    def recorded(method):
        def call(*args, **kwargs):
            queries_on.append(threading.get_ident())
            return method(*args, **kwargs)

        return call

    monkeypatch.setattr(TxQueueBackend, "enqueue", recorded(enqueue))
    monkeypatch.setattr(TxQueueBackend, "get_result", recorded(get_result))

    async def from_a_view():
        result = await tasks.add.aenqueue(2, 3)
        again = await tasks.add.aget_result(result.id)
        return threading.get_ident(), again

    loop_thread, again = async_to_sync(from_a_view)()
    assert again.args == [2, 3] and len(queries_on) == 2
    assert loop_thread not in queries_on


@needs_tasks
@consumed
def test_async_task_runs(run_consumer):
    result = tasks.async_double.enqueue(21)
    run_consumer("--burst")
    done = tasks.async_double.get_result(result.id)
    assert done.status == TaskResultStatus.SUCCESSFUL
    value: Any = done.return_value  # a coroutine's result
    assert value == 42
    assert item_of(result).result == 42


@needs_tasks
@consumed
def test_return_value_is_normalised(run_consumer):
    result = tasks.pair.enqueue(3)
    run_consumer("--burst")
    value: Any = tasks.pair.get_result(result.id).return_value  # JSON: a list
    assert value == [3, 3]
    assert item_of(result).result == [3, 3]


@needs_tasks
@consumed
def test_non_json_return_value_fails_the_task_naming_it(run_consumer, run_once):
    result = tasks.unserialisable.enqueue()

    run_consumer("--burst")

    item = item_of(result)
    assert (item.status, item.result) == (Status.FAILED, None)
    failed = tasks.unserialisable.get_result(result.id)
    assert failed.status == TaskResultStatus.FAILED
    error = failed.errors[0]
    # TypeError itself, as Django's backends report it; the item records the queue's own
    # NotJSONSerializable, which is why it was not retried.
    assert error.exception_class_path == "builtins.TypeError"
    assert error.exception_class is TypeError
    assert item.error_class == "django_txqueue.exceptions.NotJSONSerializable"
    assert "Unsupported type: <class 'object'>" in error.traceback  # Django's wording
    assert "return value of task tests.testapp.tasks.unserialisable" in error.traceback
    assert "Object of type object is not JSON serializable" in error.traceback


@needs_tasks
@consumed
def test_non_json_return_value_fails_at_once_like_a_handlers(run_consumer):
    result = tasks.unserialisable.enqueue()  # the default 5 attempts
    run_consumer("--burst")
    item = item_of(result)
    assert (item.status, item.attempts) == (Status.FAILED, 1)


@needs_tasks
@consumed
def test_a_task_raising_systemexit_fails_its_attempt_and_the_consumer_exits_0(
    run_consumer, run_once
):
    result = tasks.exits.enqueue()
    other = tasks.add.enqueue(1, 2)

    run_consumer("--burst")  # returns: neither SystemExit nor a non-zero exit escapes

    item = item_of(result)
    assert (item.status, item.attempts, item.error_class) == (
        Status.FAILED,
        1,
        "builtins.SystemExit",
    )
    failed = tasks.exits.get_result(result.id)
    assert failed.status == TaskResultStatus.FAILED
    assert failed.errors[0].exception_class_path == "builtins.SystemExit"
    assert failed.errors[0].exception_class is SystemExit
    assert tasks.add.get_result(other.id).return_value == 3  # the consumer went on
    assert Consumer.objects.get().stopped_at is not None


@needs_tasks
@consumed
def test_a_task_raising_systemexit_is_retried_like_any_failure(run_consumer):
    result = tasks.exits.enqueue()  # the default 5 attempts, RETRY_DELAY 10 s

    run_consumer("--burst")

    item = item_of(result)
    assert (item.status, item.attempts, item.error_class) == (
        Status.READY,
        1,
        "builtins.SystemExit",
    )
    assert tasks.exits.get_result(result.id).errors[0].exception_class is SystemExit


@needs_tasks
@consumed
def test_signals_are_sent(run_consumer):
    seen = []

    def record(signal):
        def receiver(sender, task_result, **kwargs):
            seen.append((signal, str(task_result.status)))

        return receiver

    receivers = {name: record(name) for name in ("enqueued", "started", "finished")}
    for name, receiver in receivers.items():
        getattr(signals, f"task_{name}").connect(receiver)
    try:
        tasks.add.enqueue(1, 2)
        run_consumer("--burst")
    finally:
        for name, receiver in receivers.items():
            getattr(signals, f"task_{name}").disconnect(receiver)
    assert seen == [("enqueued", "READY"), ("started", "RUNNING"), ("finished", "SUCCESSFUL")]


@needs_tasks
@consumed
def test_failure_signals_are_sent_with_the_error(run_consumer, run_once):
    finished = []

    def receiver(sender, task_result, **kwargs):
        finished.append(
            (str(task_result.status), [e.exception_class_path for e in task_result.errors])
        )

    signals.task_finished.connect(receiver)
    try:
        tasks.boom.enqueue("x")
        tasks.unserialisable.enqueue()
        run_consumer("--burst")
    finally:
        signals.task_finished.disconnect(receiver)
    assert sorted(finished) == [
        ("FAILED", ["builtins.TypeError"]),  # as get_result reports it
        ("FAILED", ["tests.testapp.tasks.TaskBoom"]),
    ]


@needs_tasks
@consumed
def test_tasks_of_both_queues_and_handler_queues_in_one_run(run_consumer):
    on_default = tasks.add.enqueue(1, 2)
    on_other = tasks.shout.enqueue("hi")
    echo = enqueue("echo", {"plain": True})

    run_consumer("--burst")

    assert tasks.add.get_result(on_default.id).return_value == 3
    assert tasks.shout.get_result(on_other.id).return_value == "HI"
    assert QueueItem.objects.get(pk=echo.pk).result == {"plain": True}


@needs_tasks
def test_unknown_ids_do_not_exist(db):
    backend = tasks.add.get_backend()
    plain = enqueue("default", {"not": "a task"})
    elsewhere = enqueue("not-a-task-queue", {"task": "tests.testapp.tasks.add"})
    for result_id in ["999999999", "9" * 30, "nope", "", str(plain.pk), str(elsewhere.pk)]:
        with pytest.raises(exceptions.TaskResultDoesNotExist):
            backend.get_result(result_id)


@needs_tasks
def test_result_of_another_task_is_a_mismatch(db):
    result = tasks.add.enqueue(1, 2)
    with pytest.raises(exceptions.TaskResultMismatch):
        tasks.shout.get_result(result.id)


# -- handlers ------------------------------------------------------------------------


@needs_tasks
def test_task_handlers_cover_every_queue_of_the_backend():
    assert task_handlers() == {"default": run_task, "tasks-other": run_task}
    assert {"default", "tasks-other"} <= set(handlers())


@needs_tasks
def test_task_handlers_ignore_other_backends(settings):
    settings.TASKS = {
        "default": {"BACKEND": f"{TASKS_FRAMEWORK}.backends.immediate.ImmediateBackend"},
        "missing": {"BACKEND": "no.such.Backend"},
    }
    assert task_handlers() == {}


@needs_tasks
def test_task_handlers_of_several_backends_and_subclasses(settings):
    settings.TASKS = {
        "default": {"BACKEND": "django_txqueue.backends.TxQueueBackend", "QUEUES": ["a"]},
        "more": {"BACKEND": "tests.testapp.backends.MyBackend", "QUEUES": ["b", "c"]},
    }
    assert task_handlers() == {"a": run_task, "b": run_task, "c": run_task}


def test_no_tasks_setting_means_no_handlers(settings):
    del settings.TASKS
    assert task_handlers() == {}


@needs_tasks
def test_database_option(db):
    backend = TxQueueBackend("x", {"QUEUES": ["default"], "OPTIONS": {"DATABASE": "default"}})
    assert backend.database == "default"
    assert backend.databases() == ["default"]
    assert TxQueueBackend("x", {}).database is None


@needs_tasks
def test_checks():
    assert TxQueueBackend("x", {"QUEUES": ["default"]}).check() == []
    assert TxQueueBackend("x", {"QUEUES": []}).check() == []  # any queue name
    assert [m.id for m in TxQueueBackend("x", {"QUEUES": ["q" * 101]}).check()] == ["txqueue.E102"]


# -- any queue name (QUEUES = []) ---------------------------------------------------


@pytest.fixture
def any_queue(settings):
    """A TxQueueBackend whose tasks may use any queue name ("QUEUES": []). Changing TASKS
    makes Django's Tasks framework (and the backport) drop their cached backends."""
    settings.TASKS = {
        "default": {"BACKEND": "django_txqueue.backends.TxQueueBackend", "QUEUES": []}
    }
    assert tasks.add.get_backend().queues == set()


@needs_tasks
# Django's model checks ask every database's features (SQLite's JSON support: a query).
@pytest.mark.django_db(databases=["default", "other"])
def test_any_queue_name_passes_the_system_checks(any_queue):
    messages = django_checks.run_checks()
    assert [m for m in messages if m.level >= django_checks.WARNING] == []


@needs_tasks
def test_listed_queues_take_no_other_name(db):
    assert any_task_queue() is False
    enqueue("unlisted", {"task": "tests.testapp.tasks.add", "args": [1, 2], "kwargs": {}})
    assert find_task_queue("unlisted") is None
    assert find_task_queue("unlisted") is None


@needs_tasks
def test_any_queue_name_finds_task_queues_by_their_next_item(any_queue, db):
    assert any_task_queue() is True
    assert task_handlers() == {}  # no queue is listed: they are found as items arrive
    assert find_task_queue("brand-new") is None  # nothing there yet
    tasks.add.using(queue_name="brand-new").enqueue(1, 2)
    enqueue("plain", {"not": "a task"})
    assert find_task_queue("brand-new") is run_task
    assert find_task_queue("brand-new") is run_task
    assert find_task_queue("plain") is None
    assert find_task_queue("plain") is None


@needs_tasks
@consumed
def test_burst_consumer_serves_task_queues_it_was_never_told_about(any_queue, run_consumer):
    first = tasks.add.using(queue_name="brand-new").enqueue(1, 2)
    second = tasks.shout.using(queue_name="also-new").enqueue("hi", times=2)
    plain = enqueue("no-handler", {"not": "a task"})

    run_consumer("--burst")

    assert tasks.add.get_result(first.id).return_value == 3
    assert tasks.shout.get_result(second.id).return_value == "HIHI"
    stored = QueueItem.objects.get(pk=plain.pk)
    assert (stored.status, stored.attempts, stored.pid) == (Status.READY, 0, "")


@needs_tasks
@consumed
def test_named_queues_only_when_names_are_given(any_queue, run_consumer):
    result = tasks.add.using(queue_name="brand-new").enqueue(1, 2)
    run_consumer("echo", "--burst")
    assert item_of(result).status == Status.READY


@needs_tasks
@consumed
def test_a_running_consumer_finds_new_task_queues_without_a_restart(
    any_queue, settings, monkeypatch
):
    """The real command with no queue names, in a thread (its signal handlers are left
    out: only the main thread may install them); stopped as a signal would stop it."""
    settings.TXQUEUE = {**settings.TXQUEUE, "POLL_INTERVAL": 0.1, "HEARTBEAT_INTERVAL": 0.1}
    monkeypatch.setattr("django_txqueue.consumer.rotation.DISCOVERY_INTERVAL", 0.1)
    workers, errors = [], []

    class RecordedWorker(Worker):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            workers.append(self)

    monkeypatch.setattr(run_queue_consumer, "Worker", RecordedWorker)
    monkeypatch.setattr(run_queue_consumer.StopSignals, "install", lambda self, stop: None)

    def consume():
        try:
            call_command("run_queue_consumer", verbosity=0)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=consume)
    thread.start()
    try:
        assert wait_for(lambda: workers and Consumer.objects.exists(), 20), errors
        plain = enqueue("no-handler", {"not": "a task"})
        first = tasks.add.using(queue_name="brand-new").enqueue(1, 2)
        assert wait_for(lambda: item_of(first).status == Status.DONE, 10)
        second = tasks.shout.using(queue_name="newer-still").enqueue("hi")
        assert wait_for(lambda: item_of(second).status == Status.DONE, 10)
        # The Consumer row names the queues found, so producers' wake-ups reach it.
        assert wait_for(
            lambda: {"brand-new", "newer-still"} <= set(Consumer.objects.get().queues), 5
        )
        time.sleep(0.3)  # a few more discovery rounds: the plain item stays alone
    finally:
        for worker in workers:
            worker.stop()
        thread.join(15)
    assert not thread.is_alive()
    assert errors == []

    assert tasks.add.get_result(first.id).return_value == 3
    assert tasks.shout.get_result(second.id).return_value == "HI"
    consumer = Consumer.objects.get()  # one consumer all along
    assert consumer.stopped_at is not None
    assert {item_of(first).pid, item_of(second).pid} == {consumer.identity}
    stored = QueueItem.objects.get(pk=plain.pk)
    assert (stored.status, stored.attempts, stored.pid) == (Status.READY, 0, "")
    [worker] = workers
    assert {"brand-new", "newer-still"} <= set(worker.queues)
    assert "no-handler" not in worker.queues


# -- without a Tasks framework -------------------------------------------------------


def test_module_imports_without_a_tasks_framework(monkeypatch):
    for name in ("django.tasks", "django_tasks"):
        monkeypatch.setitem(sys.modules, name, None)  # makes importing it fail
    spec = importlib.util.spec_from_file_location(
        "django_txqueue.tasks._backend_probe", txbackends.__file__
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    assert module.TASKS_FRAMEWORK is None
    assert module.task_handlers() == {}
    with pytest.raises(ImproperlyConfigured, match="Tasks framework"):
        module.TxQueueBackend("default", {})


def test_importing_the_package_loads_no_tasks_framework():
    code = (
        "import sys, django; django.setup(); import django_txqueue; "
        "print(sorted(m for m in sys.modules if m.startswith("
        "('django_txqueue.backends', 'django_txqueue.tasks', 'django.tasks', 'django_tasks'))))"
    )
    env = {**child_env(), "TXQUEUE_TEST_NAME": ""}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@needs_tasks
@consumed
def test_a_rate_limited_tasks_queue_runs_within_its_budget(settings):
    """docs/limits.md: the Tasks backend's queue takes RATE_LIMIT by its name."""
    settings.TXQUEUE = {**settings.TXQUEUE, "QUEUES": {"default": {"RATE_LIMIT": "2/m"}}}
    results = [tasks.add.enqueue(n, 1) for n in range(3)]
    worker = Worker({"default": run_task})
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        assert wait_for(lambda: sum(item_of(r).status == Status.DONE for r in results) == 2)
        time.sleep(0.5)  # the third waits for the minute's budget, charged nothing
        statuses = sorted((item_of(r).status, item_of(r).attempts) for r in results)
        assert statuses == [(Status.READY, 0), (Status.DONE, 1), (Status.DONE, 1)]
    finally:
        worker.stop()
        thread.join(10)
