"""Django Tasks run by django_txqueue.backends.TxQueueBackend (tests/test_backends.py)."""

import asyncio
import threading
from typing import Any

try:
    from django.tasks import task
except ImportError:  # Django 5.2: the django-tasks backport
    from django_tasks import task  # type: ignore[no-redef, import-not-found, unused-ignore]


class TaskBoom(Exception):
    """Raised by a task, to find its path again in get_result's errors."""


@task
def add(a: Any, b: Any) -> Any:
    return a + b


@task(priority=10, queue_name="tasks-other")
def shout(text: str, *, times: Any = 1) -> str:
    return str(text.upper() * times)


@task
def boom(message: str) -> None:
    raise TaskBoom(message)


@task
def builtin_boom() -> None:
    raise ValueError("bad value")


@task
def not_yet() -> None:
    from django_txqueue import Snooze

    raise Snooze(60)


@task(takes_context=True)
def attempt_info(context: Any, x: int) -> dict[str, Any]:
    return {"attempt": context.attempt, "id": context.task_result.id, "x": x}


@task
async def async_double(x: int) -> int:
    return x * 2


@task
async def async_nap(seconds: float) -> str:
    """Awaits ``seconds``; the thread it ran on."""
    await asyncio.sleep(seconds)
    return threading.current_thread().name


@task
def where() -> str:
    return threading.current_thread().name


@task
def pair(x: int) -> tuple[int, int]:
    return (x, x)


@task
def unserialisable() -> object:
    return object()


@task(takes_context=True)
def fails_every_attempt(context: Any) -> None:
    """Raises naming its attempt, so that each attempt's error can be told apart."""
    raise TaskBoom(f"attempt {context.attempt}")


@task(takes_context=True)
def flaky(context: Any) -> int:
    """Fails its first attempt, succeeds on the next one."""
    if context.attempt < 2:
        raise TaskBoom("first attempt fails")
    return int(context.attempt)


@task
def exits() -> None:
    """A task that calls sys.exit(): its attempt's failure, not the consumer's end."""
    raise SystemExit(3)


@task(takes_context=True)
def reports_progress(context: Any, steps: int) -> str:
    """Reports its progress through its item, as docs/consumers.md's recipe says."""
    from django_txqueue.models import QueueItem

    item = QueueItem.objects.get(pk=context.task_result.id)
    for step in range(1, steps + 1):
        item.report_progress(step, steps, "working")
    item.write_progress()  # the last report, which the once-a-second limit held back
    return "reported"
