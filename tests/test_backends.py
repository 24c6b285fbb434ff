"""The Django Tasks backend: Task <-> QueueItem, run as the consumer runs handlers.

TASKS in tests/settings.py selects TxQueueBackend with the queues "default" and
"tasks-other"; the tasks are in tests/testapp/tasks.py. "Executing" an item here is
exactly what the consumer does: claim, call the queue's handler, then ``ack(result)``
or, in the except block, ``fail``/``retry`` with ``traceback.format_exc()``.
"""

import importlib
import importlib.util
import subprocess
import sys
import traceback
from datetime import timedelta
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from django.utils import timezone

from django_txqueue import Queue, Status, enqueue, store
from django_txqueue import backends as txbackends
from django_txqueue.backends import (
    TASKS_FRAMEWORK,
    ItemFailed,
    TxQueueBackend,
    run_task,
    task_handlers,
)
from django_txqueue.models import QueueItem
from django_txqueue.registry import handlers

from .conftest import ROOT, child_env

needs_tasks = pytest.mark.skipif(
    TASKS_FRAMEWORK is None,
    reason="no Tasks framework: Django < 6.0 without the django-tasks backport",
)

if TASKS_FRAMEWORK is not None:
    from tests.testapp import tasks

    framework = importlib.import_module(TASKS_FRAMEWORK)
    TaskResultStatus = framework.TaskResultStatus
    exceptions = importlib.import_module(f"{TASKS_FRAMEWORK}.exceptions")
    signals = importlib.import_module(f"{TASKS_FRAMEWORK}.signals")

ITEM_FAILED = f"{ItemFailed.__module__}.{ItemFailed.__qualname__}"


def claim_one(queue="default"):
    claimed = Queue(queue).claim()
    assert len(claimed) == 1
    return claimed[0]


def execute(item):
    """Run a claimed item as the consumer does; returns the handler's outcome."""
    try:
        value = task_handlers()[item.queue](item)
    except Exception as exc:
        path = f"{type(exc).__module__}.{type(exc).__qualname__}"
        assert store.fail(item, traceback.format_exc(), error_class=path)
        return None
    assert item.ack(result=value)
    return value


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
def test_successful_task_shows_its_return_value(db):
    result = tasks.add.enqueue(2, 3)
    item = claim_one()

    assert execute(item) == 5
    item.refresh_from_db()
    assert item.status == Status.DONE
    assert item.result == 5

    done = tasks.add.get_result(result.id)
    assert done.status == TaskResultStatus.SUCCESSFUL
    assert done.return_value == 5
    assert done.is_finished
    assert done.finished_at == item.finished_at
    assert done.started_at == item.claimed_at
    assert done.enqueued_at == item.created_at
    assert done.errors == []
    assert done.worker_ids == [item.pid]
    assert done.attempts == 1

    result.refresh()  # the result enqueue returned reads the item again
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == 5


@needs_tasks
def test_failed_task_shows_its_exception_class_and_traceback(db):
    result = tasks.boom.enqueue("it broke")
    item = claim_one()

    assert execute(item) is None
    item.refresh_from_db()
    assert item.status == Status.FAILED

    failed = tasks.boom.get_result(result.id)
    assert failed.status == TaskResultStatus.FAILED
    assert failed.is_finished
    assert failed.finished_at == item.finished_at
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
def test_builtin_exception_is_named_in_builtins(db):
    result = tasks.builtin_boom.enqueue()
    execute(claim_one())

    error = tasks.builtin_boom.get_result(result.id).errors[0]
    assert error.exception_class_path == "builtins.ValueError"
    assert error.exception_class is ValueError


@needs_tasks
def test_retried_task_is_ready_again_with_the_attempts_error(db):
    result = tasks.builtin_boom.enqueue()
    item = claim_one()
    try:
        run_task(item)
    except ValueError:
        assert store.retry(
            item, traceback.format_exc(), delay=3600, error_class="builtins.ValueError"
        )

    again = tasks.builtin_boom.get_result(result.id)
    assert again.status == TaskResultStatus.READY
    assert [error.exception_class_path for error in again.errors] == ["builtins.ValueError"]
    assert again.attempts == 1
    assert again.worker_ids == [""]  # the queue forgets a retried attempt's consumer
    assert again.finished_at is None


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
def test_task_with_context_gets_its_result_and_attempt(db):
    result = tasks.attempt_info.enqueue(7)
    assert item_of(result).payload["takes_context"] is True

    assert execute(claim_one()) == {"attempt": 1, "id": result.id, "x": 7}
    assert tasks.attempt_info.get_result(result.id).return_value["attempt"] == 1


@needs_tasks
def test_async_task_runs(db):
    result = tasks.async_double.enqueue(21)
    assert execute(claim_one()) == 42
    value: Any = tasks.async_double.get_result(result.id).return_value  # a coroutine's result
    assert value == 42


@needs_tasks
def test_return_value_is_normalised(db):
    result = tasks.pair.enqueue(3)
    assert execute(claim_one()) == [3, 3]
    value: Any = tasks.pair.get_result(result.id).return_value  # JSON: a list
    assert value == [3, 3]


@needs_tasks
def test_non_json_return_value_fails_the_task_naming_it(db):
    result = tasks.unserialisable.enqueue()
    item = claim_one()
    with pytest.raises(TypeError, match="return value of task tests.testapp.tasks.unserialisable"):
        run_task(item)
    execute(item)
    error = tasks.unserialisable.get_result(result.id).errors[0]
    assert error.exception_class_path == "builtins.TypeError"


@needs_tasks
def test_signals_are_sent(db):
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
        execute(claim_one())
    finally:
        for name, receiver in receivers.items():
            getattr(signals, f"task_{name}").disconnect(receiver)
    assert seen == [("enqueued", "READY"), ("started", "RUNNING"), ("finished", "SUCCESSFUL")]


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
        "more": {"BACKEND": "tests.test_backends.MyBackend", "QUEUES": ["b", "c"]},
    }
    assert task_handlers() == {"a": run_task, "b": run_task, "c": run_task}


class MyBackend(TxQueueBackend):
    pass


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


# -- without a Tasks framework -------------------------------------------------------


def test_module_imports_without_a_tasks_framework(monkeypatch):
    for name in ("django.tasks", "django_tasks"):
        monkeypatch.setitem(sys.modules, name, None)  # makes importing it fail
    spec = importlib.util.spec_from_file_location(
        "django_txqueue._backends_probe", txbackends.__file__
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
        "('django_txqueue.backends', 'django.tasks', 'django_tasks'))))"
    )
    env = {**child_env(), "TXQUEUE_TEST_NAME": ""}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
