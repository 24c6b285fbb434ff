"""django-txqueue: a reliable, fast work queue in your Django project's own database.

The public API is re-exported lazily, so ``import django_txqueue``
from settings never loads models before Django is ready.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .api import Queue, aenqueue, aenqueue_many, enqueue, enqueue_many, run_in_transaction
    from .consumer.registry import handler
    from .exceptions import ItemTimeout, QueueFull, Snooze
    from .flows import Flow, chain, group, step
    from .idempotency import once
    from .models import Consumer, QueueItem, QueueModel, Status
    from .outbox import on_commit

__all__ = [
    "Consumer",
    "Flow",
    "ItemTimeout",
    "Queue",
    "QueueFull",
    "QueueItem",
    "QueueModel",
    "Snooze",
    "Status",
    "aenqueue",
    "aenqueue_many",
    "chain",
    "enqueue",
    "enqueue_many",
    "group",
    "handler",
    "on_commit",
    "once",
    "run_in_transaction",
    "step",
]

_HOMES = {
    "Queue": "api",
    "aenqueue": "api",
    "aenqueue_many": "api",
    "enqueue": "api",
    "enqueue_many": "api",
    "run_in_transaction": "api",
    "ItemTimeout": "exceptions",
    "QueueFull": "exceptions",
    "Snooze": "exceptions",
    "Flow": "flows",
    "chain": "flows",
    "group": "flows",
    "step": "flows",
    "Consumer": "models",
    "QueueItem": "models",
    "QueueModel": "models",
    "Status": "models",
    "handler": "consumer.registry",
    "on_commit": "outbox",
    "once": "idempotency",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
