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
_atomic: set[str] = set()


def handler(queue: str, *, atomic: bool = False) -> Callable[[H], H]:
    """Register the decorated function as the handler of ``queue``.

    It receives the claimed ``QueueItem``; its return value (JSON) is stored as the
    item's ``result``; an exception means a retry with back-off, or FAILED once
    ``max_attempts`` are spent. With ``atomic``, it runs in a transaction on the queue's
    database that ends with the item's fenced acknowledgement: its writes commit with
    the acknowledgement, or roll back with it when the claim was taken over.
    """
    validate_queue_name(queue)
    if not isinstance(atomic, bool):
        raise TypeError(f"atomic must be True or False, not {atomic!r}")

    def register(func: H) -> H:
        existing = _handlers.get(queue)
        if existing is not None and existing is not func:
            raise ValueError(
                f"queue {queue!r} already has a handler: "
                f"{existing.__module__}.{existing.__qualname__}"
            )
        _handlers[queue] = func
        if atomic:
            _atomic.add(queue)
        else:
            _atomic.discard(queue)
        return func

    return register


def autodiscover() -> None:
    """Import every installed app's ``queues`` module, registering its handlers."""
    autodiscover_modules("queues")


def handlers() -> dict[str, Handler]:
    """Queue name to handler: registered handlers plus the Django Tasks queues."""
    return {**task_handlers(), **_handlers}


def is_atomic(queue: str) -> bool:
    """Whether ``queue``'s handler was registered with ``atomic=True``."""
    return queue in _atomic


def unregister(queue: str) -> None:
    """Forget a queue's handler (for tests)."""
    _handlers.pop(queue, None)
    _atomic.discard(queue)
