"""Signals for users' metrics. Sent by the consumer, with ``sender`` the QueueItem class.

- ``item_claimed(item=...)``: a consumer claimed the item and is about to run it.
- ``item_done(item=..., result=..., duration=...)``: the handler returned; acknowledged.
- ``item_failed(item=..., error=..., will_retry=..., duration=...)``: the handler raised.
"""

from typing import Any

from django.dispatch import Signal

item_claimed = Signal()
item_done = Signal()
item_failed = Signal()


def heard(sender: Any) -> frozenset[Signal]:
    """The signals above that have a receiver for ``sender``. The consumer asks once per
    batch and sends nothing item by item when nobody listens; an empty ``receivers``
    list, the usual case, answers without ``has_listeners``' locking and cache look-ups."""
    return frozenset(
        signal
        for signal in (item_claimed, item_done, item_failed)
        if signal.receivers and signal.has_listeners(sender)
    )
