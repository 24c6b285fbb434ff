"""A durable ``transaction.on_commit``: the call is a queue item, written in the caller's
transaction, that the committing process runs right after commit.

The committing process claims its own item after commit before it runs the call, and a
consumer can only run a call it claimed: the claim decides who runs it, so a call runs
once. Consumers claim these items at start-up and whenever they are idle (and at least
every ``POLL_INTERVAL``); they are not woken for them, so that the committing process,
which claims within a millisecond of its commit, normally wins. If it dies before it
claims, the next consumer runs the call; if it dies during the call, the item is stuck
and rescued like any other.
"""

from __future__ import annotations

import functools
import inspect
import logging
import traceback
from collections.abc import Callable
from typing import Any

from django.db import connections, transaction
from django.utils.module_loading import import_string

from . import conf, store
from .api import Queue, refuse_other_transaction
from .models import QueueItem
from .observe import tracing
from .validation import check_json

logger = logging.getLogger(__name__)

# The queue holding the calls. Its per-queue settings (LEASE, MAX_ATTEMPTS...) apply.
QUEUE = "django_txqueue.on_commit"


def on_commit(func: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Run ``func(*args, **kwargs)`` after the current transaction commits, at least once.

    ``func`` must be an importable module-level function and the arguments JSON; both
    are checked before anything is written. Outside a transaction it runs at once.
    """
    path = function_path(func)
    check_json(list(args), f"the arguments of {path}")
    check_json(kwargs, f"the keyword arguments of {path}")
    using = Queue(QUEUE).using
    refuse_other_transaction(using, f"on_commit({path})")
    if not connections[using].in_atomic_block:
        func(*args, **kwargs)
        return
    item = QueueItem(
        queue=QUEUE,
        payload={"func": path, "args": list(args), "kwargs": kwargs},
        max_attempts=conf.queue_option(QUEUE, "MAX_ATTEMPTS"),
        trace_context=tracing.current_context(),
    )
    store.insert(item, using)
    transaction.on_commit(functools.partial(run_after_commit, item.pk, using), using=using)


def function_path(func: Any) -> str:
    """The dotted path that imports ``func``; ValueError if there is none."""
    module, name = getattr(func, "__module__", None), getattr(func, "__qualname__", None)
    if inspect.ismethod(func) or not module or not name or "." in name or "<" in name:
        raise ValueError(
            f"on_commit needs an importable module-level function, not {func!r}: a lambda, "
            "a nested function or a method cannot be found again after a crash"
        )
    path = f"{module}.{name}"
    try:
        found = import_string(path)
    except ImportError:
        found = None
    if found is not func:
        raise ValueError(f"on_commit needs an importable function: {path} is not {func!r}")
    return path


def run_after_commit(pk: int, using: str) -> None:
    """In the committing process: claim the call's item and run it, unless a consumer
    claimed it first. An exception is logged and the call retried by consumers."""
    claimed = QueueItem.objects.using(using).filter(pk=pk, queue=QUEUE).claim()
    if not claimed:
        return  # a consumer has it
    [item] = claimed
    try:
        run_call(item)
    except Exception as exc:
        logger.exception("on_commit call %s failed; consumers will retry it", item.payload)
        cls = type(exc)
        store.retry(
            item,
            "".join(traceback.format_exception(exc)),
            error_class=f"{cls.__module__}.{cls.__qualname__}",
        )
    else:
        item.ack()


def run_call(item: QueueItem) -> None:
    """Run the call stored in ``item`` (the consumers' handler for ``QUEUE``)."""
    payload = item.payload
    if not isinstance(payload, dict) or not isinstance(payload.get("func"), str):
        raise ValueError(f"item {item.pk} of queue {QUEUE!r} holds no call: {payload!r}")
    func = import_string(payload["func"])
    func(*payload["args"], **payload["kwargs"])
