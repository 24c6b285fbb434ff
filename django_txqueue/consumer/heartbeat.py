"""The heartbeat job: a consumer's ``Consumer`` row kept alive, the leases of the items it
holds renewed, and which of them were asked to stop read back, on one tick.

The tick is ``HEARTBEAT_INTERVAL``, or a third of the shortest lease the consumer gives if
that is shorter, so that no rescue takes an item from a live consumer. An item whose
handler has run past its queue's ``TIMEOUT`` is not renewed: its lease lapses, and a rescue
takes it back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from datetime import timedelta

from .. import conf, store
from ..api import Queue
from ..models import Consumer, QueueItem

# (item, monotonic time its handler started or None) for each item in flight.
Held = Callable[[], Iterable[tuple[QueueItem, "float | None"]]]


def interval(queues: Iterable[Queue], lease: float | None) -> float:
    """Seconds to the next heartbeat: HEARTBEAT_INTERVAL, or a third of the shortest
    lease given to ``queues``' items, whichever is shorter."""
    leases = [store.lease_of(queue.name, lease) for queue in queues]
    shortest = min(leases, default=timedelta.max).total_seconds()
    return float(min(conf.get("HEARTBEAT_INTERVAL"), shortest / 3))


def beat(consumer: Consumer, queues: Iterable[Queue], counters: tuple[int, int]) -> None:
    """The consumer is alive, with its counters and the queues it serves now."""
    processed, failed = counters
    names = [queue.name for queue in queues]
    store.beat(consumer, processed=processed, failed=failed, queues=names)


def renew_leases(alias: str, held: Held, lease: float | None) -> None:
    """Extend the leases of items still being worked on (not those past TIMEOUT), one
    UPDATE per lease length."""
    now = time.monotonic()
    by_lease: dict[timedelta, dict[int, int]] = {}
    for item, started in held():
        timeout = conf.queue_option(item.queue, "TIMEOUT")
        if timeout is not None and started is not None and now - started > timeout:
            continue  # hung or too slow: let the lease lapse so it can be rescued
        by_lease.setdefault(store.lease_of(item.queue, lease), {})[item.pk] = item.claim_token  # type: ignore[assignment]
    for duration, tokens in by_lease.items():
        store.renew_leases(QueueItem, alias, tokens, duration)


def read_cancel_requests(alias: str, held: Held) -> None:
    """One read of which held items were asked to stop; their handlers' instances learn it
    (``QueueItem.cancel_requested()``), with no query of theirs. Nothing held, nothing
    read."""
    items = {item.pk: item for item, _ in held()}
    tokens = {pk: item.claim_token for pk, item in items.items() if item.claim_token}
    asked = QueueItem.objects.using(alias).cancel_requests(tokens)
    for pk, requested_at in asked.items():
        items[pk].cancel_requested_at = requested_at
