"""Helpers for a project's own tests (docs/testing.md), for pytest and Django's
``TestCase`` alike: what a test enqueued (``assert_enqueued``, ``assert_not_enqueued``),
and running it in the test's own thread and transaction (``drain``, ``run_item``), through
the consumer's real claim, handler and acknowledgement path.

Everything runs on the calling thread's connection, so a ``TestCase`` (whose test runs
inside a transaction that is rolled back) sees what a handler wrote, and the handler sees
what the test wrote. The pytest plugin (``pytest_plugin``) gives them as the ``txqueue``
fixture.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from asgiref.sync import async_to_sync

from .api import Queue, items_database
from .consumer import registry, wakeup
from .consumer.coroutines import arun_item
from .consumer.execution import Outcome, runner
from .consumer.settle import Settler
from .models import QueueItem, Status
from .validation import validate_queue_name

# The pid the helpers claim under, as a consumer's identity would be.
PID = "txqueue-testing"
# Any payload: ``assert_enqueued``'s default.
ANY: Any = object()


def enqueued(
    queue: str, payload: Any = ANY, *, using: str | None = None, **fields: Any
) -> list[QueueItem]:
    """The items of ``queue`` the caller's transaction sees, with ``payload`` (equal as
    JSON values; ``ANY``: whatever it is) and ``fields`` (``key="x"``, ``priority=1``,
    ``status=Status.READY``, or any lookup: ``run_at__gt=...``), oldest first."""
    validate_queue_name(queue)
    rows = _queue(queue, using).items.filter(**fields).order_by("pk")
    return [item for item in rows if payload is ANY or item.payload == payload]


def assert_enqueued(
    queue: str,
    payload: Any = ANY,
    count: int | None = None,
    *,
    using: str | None = None,
    **fields: Any,
) -> list[QueueItem]:
    """Assert that the caller's transaction sees items of ``queue`` like these (whatever
    their status: an item run already was enqueued too): ``count`` of them exactly, or
    at least one; returns them. The failure lists what the queue holds."""
    found = enqueued(queue, payload, using=using, **fields)
    if (len(found) == count) if count is not None else found:
        return found
    wanted = "an item" if count is None else f"{count} item{'' if count == 1 else 's'}"
    raise AssertionError(
        f"expected {wanted} of queue {queue!r}{_described(payload, fields)}, found "
        f"{len(found)}; {_held(queue, using)}"
    )


def assert_not_enqueued(
    queue: str, payload: Any = ANY, *, using: str | None = None, **fields: Any
) -> None:
    """Assert that the caller's transaction sees no item of ``queue`` like these."""
    if found := enqueued(queue, payload, using=using, **fields):
        raise AssertionError(
            f"expected no item of queue {queue!r}{_described(payload, fields)}, found "
            f"{len(found)}: {', '.join(_item(item) for item in found[:10])}"
        )


@dataclass
class Drained:
    """What ``drain`` ran: ``counts`` by outcome ("done", "failed", "retried",
    "snoozed", "released", "refused") and the ``items`` in the order they ran, as their
    settling left them."""

    counts: Counter[str] = field(default_factory=Counter)
    items: list[QueueItem] = field(default_factory=list)

    def __getitem__(self, outcome: str) -> int:
        return self.counts[outcome]


def drain(queue: str | None = None, *, using: str | None = None) -> Drained:
    """Run every due item of ``queue`` (None: of every queue with a handler) in this
    thread, as a consumer would: claimed (rate limits, caps, fairness and pauses
    included), run by its handler, acknowledged or retried or failed; until a round of
    claims finds nothing due, so that items the handlers enqueue, and flows' next steps,
    run too. A retry's back-off makes it due later: it is left READY, as it would be.
    A queue's TIMEOUT does not stop a handler here."""
    registry.autodiscover()
    handlers = registry.handlers()
    if queue is not None and queue not in handlers:
        raise ValueError(f"no handler for queue {queue!r}; known: {', '.join(sorted(handlers))}")
    names = [queue] if queue is not None else sorted(handlers)
    drained = Drained()
    while True:
        ran = 0
        for name in names:
            queue_object = _queue(name, using)
            for item in queue_object.claim(10, pid=PID):
                _run(handlers[name], item, queue_object.using, drained)
                ran += 1
        if not ran:
            return drained


def run_item(item: QueueItem) -> QueueItem:
    """Claim ``item`` (READY and due) and run its handler as a consumer would, settling
    what it came to; returns the item as that left it. A ValueError if it is not due or
    its queue has no handler."""
    registry.autodiscover()
    handle = registry.handlers().get(item.queue)
    if handle is None:
        raise ValueError(f"no handler for queue {item.queue!r}")
    using = item._state.db or items_database(item.queue)
    claimed = QueueItem.objects.using(using).filter(pk=item.pk).claim(1, pid=PID)
    if not claimed:
        status = QueueItem.objects.using(using).filter(pk=item.pk).values_list("status")
        raise ValueError(
            f"item #{item.pk} of queue {item.queue!r} is not READY and due "
            f"(status {Status(status[0][0]).label if status else 'deleted'})"
        )
    drained = Drained()
    _run(handle, claimed[0], using, drained)
    return drained.items[0]


@contextmanager
def inline() -> Iterator[None]:
    """Inside the block, every enqueue runs its queue's due items at once, in the
    caller's thread and transaction (``drain``), before ``enqueue`` returns: a test tool
    (Celery's eager mode), never for production, where an enqueue must not wait for its
    handler. Items enqueued by handlers run too; delayed items wait, as a retry does."""
    previous, wakeup.inline = wakeup.inline, _run_inline
    try:
        yield
    finally:
        wakeup.inline = previous


_inline = threading.local()  # the queues an inline run has yet to drain


def _run_inline(queue: str, using: str) -> None:
    pending: set[tuple[str, str]] | None = getattr(_inline, "pending", None)
    if pending is not None:  # enqueued by a handler run inline: the outer run drains it
        pending.add((queue, using))
        return
    _inline.pending = pending = {(queue, using)}
    registry.autodiscover()
    try:
        while pending:
            name, alias = pending.pop()
            if name in registry.handlers():  # no handler here: left enqueued
                drain(name, using=alias)
    finally:
        _inline.pending = None


def _queue(name: str, using: str | None) -> Queue:
    """Queue ``name`` where its items are (a Tasks backend's DATABASE too), or on ``using``."""
    return Queue(name, using=using or items_database(name))


def _run(handle: registry.Handler, item: QueueItem, using: str, drained: Drained) -> None:
    choose = registry.chooser(handle)
    if choose is not None and (coroutine := choose(item)) is not None:
        # On an event loop of asgiref's, whose async ORM calls come back to this thread
        # (and so into the test's transaction).
        outcome = async_to_sync(arun_item)(coroutine, item, None)
    else:
        outcome = runner()(handle, item)
    Settler(using).settle([outcome])
    drained.counts[_kind(outcome)] += 1
    item.refresh_from_db(using=using)
    drained.items.append(item)


def _kind(outcome: Outcome) -> str:
    if outcome.lost:
        return "released"
    if outcome.snooze is not None:
        return "snoozed"
    if outcome.acknowledged is False:
        return "refused"
    if outcome.error is None:
        return "done"
    return "retried" if outcome.item.status == Status.READY else "failed"


def _described(payload: Any, fields: dict[str, Any]) -> str:
    parts = [] if payload is ANY else [f"payload {payload!r}"]
    parts += [f"{name}={value!r}" for name, value in fields.items()]
    return f" with {', '.join(parts)}" if parts else ""


def _held(queue: str, using: str | None) -> str:
    items = list(_queue(queue, using).items.order_by("pk")[:11])
    if not items:
        return "the queue has no items"
    listed = ", ".join(_item(item) for item in items[:10])
    return f"the queue holds: {listed}{', ...' if len(items) > 10 else ''}"


def _item(item: QueueItem) -> str:
    return f"#{item.pk} {Status(item.status).label} {item.payload!r}"


__all__ = [
    "ANY",
    "Drained",
    "assert_enqueued",
    "assert_not_enqueued",
    "drain",
    "enqueued",
    "inline",
    "run_item",
]
