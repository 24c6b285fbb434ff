"""Handlers: ``@handler("queue")`` registers the function that processes a queue.

Handlers live in ``queues.py`` modules of installed apps, imported by ``autodiscover()``
when a consumer starts, as the admin imports ``admin.py``. The Django Tasks queues come
from the Tasks backend.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from django.utils.module_loading import autodiscover_modules

from .backends import task_handlers
from .validation import validate_queue_name

Handler = Callable[[Any], Any]
H = TypeVar("H", bound=Handler)

_handlers: dict[str, Handler] = {}


def handler(queue: str) -> Callable[[H], H]:
    """Register the decorated function as the handler of ``queue``.

    It receives the claimed ``QueueItem``; its return value (JSON) is stored as the
    item's ``result``; an exception means a retry with back-off, or FAILED once
    ``max_attempts`` are spent.
    """
    validate_queue_name(queue)

    def register(func: H) -> H:
        existing = _handlers.get(queue)
        if existing is not None and existing is not func:
            raise ValueError(
                f"queue {queue!r} already has a handler: "
                f"{existing.__module__}.{existing.__qualname__}"
            )
        _handlers[queue] = func
        return func

    return register


def autodiscover() -> None:
    """Import every installed app's ``queues`` module, registering its handlers."""
    autodiscover_modules("queues")


def handlers() -> dict[str, Handler]:
    """Queue name to handler: registered handlers plus the Django Tasks queues."""
    return {**task_handlers(), **_handlers}


def unregister(queue: str) -> None:
    """Forget a queue's handler (for tests)."""
    _handlers.pop(queue, None)
