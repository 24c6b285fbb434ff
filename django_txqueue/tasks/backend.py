"""A backend for Django's Tasks framework: ``@task`` functions run as QueueItems.

``TASKS = {"default": {"BACKEND": "django_txqueue.backends.TxQueueBackend"}}`` makes
``my_task.enqueue(...)`` store one QueueItem on the task's queue, inside the caller's
transaction; ``run_queue_consumer`` runs it through ``task_handlers()``; ``get_result``
reads the item back as a TaskResult. The backend is a thin adapter: everything about
claiming, retries and leases is the queue's own.

Django 6.0+ has the framework as ``django.tasks``; Django 5.2 gets the same API from
the ``django-tasks`` backport (``django_tasks``). Without either this module still
imports, ``task_handlers()`` returns ``{}`` and the backend refuses to start.
"""

from __future__ import annotations

import dataclasses
import json
import traceback
from asyncio import iscoroutinefunction
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import TYPE_CHECKING, Any

from asgiref.sync import sync_to_async
from django.apps import apps
from django.conf import settings
from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone
from django.utils.module_loading import import_string

from ..api import Queue, default_database, enqueue, home_database, refuse_other_transaction
from ..consumer import registry
from ..exceptions import NotJSONSerializable, Snooze
from ..models import QueueItem, Status
from ..validation import queue_name_problem

if TYPE_CHECKING:
    from django.tasks import TaskContext, TaskResult, TaskResultStatus, task_backends
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import TASK_MAX_PRIORITY, TASK_MIN_PRIORITY, Task, TaskError
    from django.tasks.exceptions import TaskResultDoesNotExist
    from django.tasks.signals import task_enqueued, task_finished, task_started
    from django.utils.json import normalize_json

    TASKS_FRAMEWORK: str | None = "django.tasks"
else:
    try:
        from django.tasks import TaskContext, TaskResult, TaskResultStatus, task_backends
        from django.tasks.backends.base import BaseTaskBackend
        from django.tasks.base import TASK_MAX_PRIORITY, TASK_MIN_PRIORITY, Task, TaskError
        from django.tasks.exceptions import TaskResultDoesNotExist
        from django.tasks.signals import task_enqueued, task_finished, task_started
        from django.utils.json import normalize_json

        TASKS_FRAMEWORK = "django.tasks"
    except ImportError:
        try:
            from django_tasks import TaskContext, TaskResult, TaskResultStatus, task_backends
            from django_tasks.backends.base import BaseTaskBackend
            from django_tasks.base import (
                TASK_MAX_PRIORITY,
                TASK_MIN_PRIORITY,
                Task,
                TaskError,
            )
            from django_tasks.exceptions import TaskResultDoesNotExist

            # Also connects the backport's setting_changed receiver, which resets its
            # cached backends when a test overrides TASKS.
            from django_tasks.signals import task_enqueued, task_finished, task_started
            from django_tasks.utils import normalize_json

            TASKS_FRAMEWORK = "django_tasks"
        except ImportError:
            TASKS_FRAMEWORK = None

            class BaseTaskBackend:
                """Stands in for the missing framework, so that this module imports."""

                def __init__(self, alias, params):
                    raise ImproperlyConfigured(
                        "django_txqueue.backends.TxQueueBackend needs Django's Tasks "
                        "framework: Django 6.0+, or the django-tasks package on Django 5.2."
                    )


TaskHandler = Callable[[QueueItem], Any]

STATUSES = {
    Status.READY: "READY",
    Status.IN_PROGRESS: "RUNNING",
    Status.DONE: "SUCCESSFUL",
    Status.FAILED: "FAILED",
    # Django has no cancelled state. FAILED is the closest: final, it will not run and did
    # not succeed. READY or RUNNING would keep a caller polling for it waiting for ever.
    Status.CANCELLED: "FAILED",
    # A flow's item waiting for others (docs/flows.md): not started, as READY.
    Status.WAITING: "READY",
}


class ItemFailed(Exception):
    """The exception class of a failure recorded without one.

    ``get_result`` names it when the item has no ``error_class``: a stuck item failed
    by a rescue (its consumer died or its lease ran out), or one failed by hand.
    """


class ItemCancelled(Exception):
    """The exception class ``get_result`` names for a cancelled item (reported FAILED,
    Django's closest status) that recorded no error of its own."""


class TxQueueBackend(BaseTaskBackend):
    """Django Tasks backend storing each enqueued task as one QueueItem.

    ``QUEUES`` lists the queues its tasks may use (default ``["default"]``; ``[]``: any
    queue name); ``OPTIONS["DATABASE"]`` picks the database alias (default: the queue's
    own setting, then the router).
    """

    # run_after becomes the item's run_at: the task waits for it in the queue.
    supports_defer = True
    # Coroutine functions run through Task.call, which wraps them in async_to_sync.
    supports_async_task = True
    # get_result reads the item back, from any process, until the item is purged.
    supports_get_result = True
    # Task priority p (-100..100, higher first) is stored as item priority -p (lower first).
    supports_priority = True

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        self.database: str | None = self.options.get("DATABASE") or None

    def enqueue(
        self, task: Task[Any, Any], args: Iterable[Any], kwargs: dict[str, Any]
    ) -> TaskResult[Any, Any]:
        """Store the task as a QueueItem in the caller's transaction; return its result."""
        self.validate_task(task)
        args = json_value(list(args), f"arguments of task {task.module_path}")
        kwargs = json_value(dict(kwargs), f"keyword arguments of task {task.module_path}")
        using = self.database or home_database(task.queue_name)
        # Placed by the backend's settings, not by the caller: it must still share the
        # caller's transaction.
        refuse_other_transaction(using, f"task {task.module_path} (queue {task.queue_name!r})")
        item = enqueue(
            task.queue_name,
            {
                "task": task.module_path,
                "args": args,
                "kwargs": kwargs,
                "backend": self.alias,
                "takes_context": task.takes_context,
                "run_after": task.run_after.isoformat() if task.run_after else None,
            },
            priority=-task.priority,
            run_at=task.run_after,
            using=using,
        )
        result = task_result(item, task)
        task_enqueued.send(type(self), task_result=result)
        return result

    async def aenqueue(
        self, task: Task[Any, Any], args: Iterable[Any], kwargs: dict[str, Any]
    ) -> TaskResult[Any, Any]:
        """``enqueue`` from async code, run where Django runs async code's database work
        (``sync_to_async``, thread-sensitive), as ``django_txqueue.aenqueue``: the event
        loop goes on meanwhile. The item commits at once (docs/async.md)."""
        return await sync_to_async(self.enqueue, thread_sensitive=True)(task, args, kwargs)

    async def aget_result(self, result_id: str) -> TaskResult[Any, Any]:
        """``get_result`` from async code, off the event loop as ``aenqueue``."""
        return await sync_to_async(self.get_result, thread_sensitive=True)(result_id)

    def get_result(self, result_id: str) -> TaskResult[Any, Any]:
        """The task's result as its item stands now; TaskResultDoesNotExist if none."""
        item = self.find_item(result_id)
        if item is None:
            raise TaskResultDoesNotExist(result_id)
        return task_result(item, stored_task(item))

    def find_item(self, result_id: str) -> QueueItem | None:
        """The task item with this id on one of this backend's queues, or None."""
        try:
            pk = int(str(result_id))
        except ValueError:
            return None
        items = QueueItem.objects.filter(pk=pk)
        if self.queues:
            items = items.filter(queue__in=self.queues)
        for alias in self.databases():
            item = items.using(alias).first()
            if item is not None and is_task_payload(item.payload):
                return item
        return None

    def databases(self) -> list[str]:
        """Database aliases where this backend's queues live (usually one)."""
        if not self.queues:
            return [self.database or default_database()]
        aliases = (self.database or home_database(name) for name in sorted(self.queues))
        return list(dict.fromkeys(aliases))

    def check(self, **kwargs: Any) -> list[checks.CheckMessage]:
        messages: list[checks.CheckMessage] = list(super().check(**kwargs))
        where = f"TASKS[{self.alias!r}]"
        if not apps.is_installed("django_txqueue"):
            messages.append(
                checks.Error(
                    f"{where} uses TxQueueBackend, but django_txqueue is not installed.",
                    hint="Add 'django_txqueue' to INSTALLED_APPS.",
                    id="txqueue.E101",
                )
            )
        for name in sorted(self.queues, key=str):
            problem = queue_name_problem(name)
            if problem is not None:
                messages.append(
                    checks.Error(
                        f"{where}['QUEUES'] has {name!r}: {problem}.",
                        id="txqueue.E102",
                    )
                )
        return messages


def our_backends() -> list[TxQueueBackend]:
    """Every configured TxQueueBackend."""
    configured = getattr(settings, "TASKS", None)
    if TASKS_FRAMEWORK is None or not isinstance(configured, dict):
        return []
    found = []
    for alias, params in configured.items():
        path = params.get("BACKEND") if isinstance(params, dict) else None
        if not isinstance(path, str):
            continue
        try:
            backend_class = import_string(path)
        except ImportError:
            continue  # not ours; the framework reports it when that backend is used
        if isinstance(backend_class, type) and issubclass(backend_class, TxQueueBackend):
            backend = task_backends[alias]
            assert isinstance(backend, TxQueueBackend)  # noqa: S101 - built from that class
            found.append(backend)
    return found


class TaskQueues:
    """The configured TxQueueBackends' queues, as a source of handlers for the registry,
    which this module joins when Django (or ``registry.autodiscover``) imports it: each
    runs ``run_task``."""

    def handlers(self) -> dict[str, TaskHandler]:
        return task_handlers()

    def takes_any_queue(self) -> bool:
        return any_task_queue()

    def find(self, queue: str) -> TaskHandler | None:
        return find_task_queue(queue)

    def database(self, queue: str) -> str | None:
        for backend in our_backends():
            if backend.database and (not backend.queues or queue in backend.queues):
                return backend.database
        return None

    def databases(self) -> list[str]:
        return [alias for backend in our_backends() for alias in backend.databases()]


task_queues = TaskQueues()
registry.add_source(task_queues)


def task_handlers() -> dict[str, TaskHandler]:
    """Queue name to handler for every queue listed by a configured TxQueueBackend."""
    return {queue: run_task for backend in our_backends() for queue in sorted(backend.queues)}


def any_task_queue() -> bool:
    """Whether a configured TxQueueBackend takes any queue name (``QUEUES = []``)."""
    return any(not backend.queues for backend in our_backends())


def find_task_queue(name: str) -> TaskHandler | None:
    """``run_task`` if queue ``name`` holds tasks of a TxQueueBackend that takes any queue
    name (``QUEUES = []``), judged by the item a claim would take next; else None."""
    for backend in our_backends():
        if backend.queues:
            continue
        head = Queue(name, using=backend.database).peek()
        if head is not None and is_task_payload(head.payload):
            return run_task
    return None


def run_task(item: QueueItem) -> Any:
    """Run the task stored in ``item`` and return its (JSON) return value.

    An exception propagates to the consumer, which retries the item or fails it with
    the traceback; ``get_result`` then reports it. An ``async def`` task runs on the
    consumer's event loop instead (``arun_task``).
    """
    task = stored_task(item)
    result = task_result(item, task)
    sender = type(task.get_backend())
    task_started.send(sender, task_result=result)
    try:
        value = returned(task, task.call(*arguments(task, result), **result.kwargs))
    except Snooze:  # not finished: it runs again later, and reports then
        raise
    except BaseException as exc:  # SystemExit too: the consumer records it as a failure
        finish(result, "FAILED", error=exc)
        task_finished.send(sender, task_result=result)
        raise
    finish(result, "SUCCESSFUL", value=value)
    task_finished.send(sender, task_result=result)
    return value


async def arun_task(item: QueueItem) -> Any:
    """``run_task`` for an ``async def`` task: awaited on the consumer's event loop, its
    signals' receivers run as Django runs them from async code (``Signal.asend``). The
    result is made off the loop: a claim may leave a field for it to load (MySQL's)."""
    task = stored_task(item)
    result = await sync_to_async(task_result, thread_sensitive=True)(item, task)
    sender = type(task.get_backend())
    await task_started.asend(sender, task_result=result)
    try:
        value = returned(task, await task.acall(*arguments(task, result), **result.kwargs))
    except Snooze:
        raise
    except BaseException as exc:
        finish(result, "FAILED", error=exc)
        await task_finished.asend(sender, task_result=result)
        raise
    finish(result, "SUCCESSFUL", value=value)
    await task_finished.asend(sender, task_result=result)
    return value


def coroutine_of(item: QueueItem) -> Callable[[QueueItem], Any] | None:
    """``arun_task`` for an item of an ``async def`` task, else None (``run_task``)."""
    try:
        return arun_task if iscoroutinefunction(stored_task(item).func) else None
    except Exception:  # a payload or path gone bad: run_task fails the item, and says why
        return None


registry.choose_coroutine(run_task, coroutine_of)


def arguments(task: Task[Any, Any], result: TaskResult[Any, Any]) -> list[Any]:
    """The task's positional arguments, its context first if it takes one."""
    args = list(result.args)
    return [TaskContext(task_result=result), *args] if task.takes_context else args


def returned(task: Task[Any, Any], value: Any) -> Any:
    return json_value(value, f"return value of task {task.module_path}", NotJSONSerializable)


def finish(
    result: TaskResult[Any, Any],
    status: str,
    *,
    value: Any = None,
    error: BaseException | None = None,
) -> None:
    """Record the attempt's outcome on ``result`` (frozen), for task_finished receivers."""
    object.__setattr__(result, "status", TaskResultStatus(status))
    object.__setattr__(result, "finished_at", timezone.now())
    object.__setattr__(result, "_return_value", value)
    if error is not None:
        cls = type(error)
        result.errors.append(
            TaskError(
                exception_class_path=reported_class(f"{cls.__module__}.{cls.__qualname__}"),
                traceback="".join(traceback.format_exception(error)),
            )
        )


# A return value JSON cannot hold fails its item at once as NotJSONSerializable (the
# queue's own class, so that it is not retried), but Django's backends report TypeError.
REPORTED_CLASSES = {
    f"{NotJSONSerializable.__module__}.{NotJSONSerializable.__qualname__}": "builtins.TypeError"
}


def reported_class(path: str) -> str:
    """The exception class path a TaskError names for a failure recorded as ``path``."""
    return REPORTED_CLASSES.get(path, path)


def json_value(value: Any, what: str, error: type[Exception] | None = None) -> Any:
    """``value`` as Django's Tasks keep it (tuples become lists); else ``error``, by
    default the TypeError or ValueError Django's own backends raise.

    The message starts with Django's (``Unsupported type: ...``), then says which value
    it was, then Python's json wording (``Object of type ... is not JSON serializable``),
    which users search for.
    """
    try:
        return normalize_json(value)
    except (TypeError, ValueError) as exc:
        message = f"{exc}, in the {what}"
        try:
            json.dumps(value)
        except (TypeError, ValueError) as json_error:
            message = f"{message} ({json_error})"
        raise (error or type(exc))(message) from exc


def is_task_payload(payload: Any) -> bool:
    return isinstance(payload, dict) and isinstance(payload.get("task"), str)


def task_payload(item: QueueItem) -> dict[str, Any]:
    """The item's payload, checked to be one that ``TxQueueBackend.enqueue`` wrote."""
    payload = item.payload
    if not isinstance(payload, dict) or not is_task_payload(payload):
        raise ValueError(f"item {item.pk} of queue {item.queue!r} holds no task: {payload!r}")
    return payload


def load_task(path: str) -> Task[Any, Any]:
    """The ``@task`` object at ``path`` (its ``module_path``)."""
    found = import_string(path)
    if not isinstance(found, Task):
        raise TypeError(f"{path!r} is not a task: {found!r}")
    return found


def stored_task(item: QueueItem) -> Task[Any, Any]:
    """The task as enqueued: its function, with the item's queue, priority and backend."""
    payload = task_payload(item)
    task = load_task(payload["task"])
    run_after = payload.get("run_after")
    enqueued = {
        "queue_name": item.queue,
        "priority": max(TASK_MIN_PRIORITY, min(TASK_MAX_PRIORITY, -item.priority)),
        "backend": payload.get("backend", task.backend),
        "run_after": datetime.fromisoformat(run_after) if run_after else None,
    }
    changes = {name: value for name, value in enqueued.items() if getattr(task, name) != value}
    return dataclasses.replace(task, **changes) if changes else task


def task_result(item: QueueItem, task: Task[Any, Any]) -> TaskResult[Any, Any]:
    """The TaskResult that ``item`` stands for, as it is now."""
    payload = task_payload(item)
    status = TaskResultStatus(STATUSES[Status(item.status)])
    claimed_at = item.claimed_at if item.attempts else None
    result: TaskResult[Any, Any] = TaskResult(
        task=task,
        id=str(item.pk),
        status=status,
        enqueued_at=item.created_at,
        started_at=claimed_at,
        finished_at=item.finished_at if status in {"SUCCESSFUL", "FAILED"} else None,
        last_attempted_at=claimed_at,
        args=payload["args"],
        kwargs=payload["kwargs"],
        backend=payload.get("backend", task.backend),
        errors=task_errors(item),
        worker_ids=worker_ids(item),
    )
    if status == "SUCCESSFUL":
        object.__setattr__(result, "_return_value", item.result)
    return result


def worker_ids(item: QueueItem) -> list[str]:
    """One entry per attempt, so that ``attempts`` counts them.

    The queue remembers only the latest attempt's consumer (``pid``, cleared when the
    item goes back to READY); earlier attempts' consumers are unknown, written "".
    """
    ids = [""] * item.attempts
    if ids and item.pid:
        ids[-1] = item.pid
    return ids


def task_errors(item: QueueItem) -> list[TaskError]:
    """The latest attempt's error, kept in ``last_error``, whatever the status now."""
    if not item.last_error and item.status != Status.FAILED:
        if item.status == Status.CANCELLED:  # reported FAILED: say why
            cancelled = f"{ItemCancelled.__module__}.{ItemCancelled.__qualname__}"
            return [TaskError(exception_class_path=cancelled, traceback="cancelled")]
        return []
    unknown = f"{ItemFailed.__module__}.{ItemFailed.__qualname__}"
    path = reported_class(item.error_class or unknown)
    return [TaskError(exception_class_path=path, traceback=item.last_error)]
