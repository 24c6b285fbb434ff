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


def heard(signal: Signal, sender: Any) -> bool:
    """Whether ``signal`` has a receiver for ``sender``. The consumer asks once per batch
    and sends nothing item by item when nobody listens; the empty ``receivers`` list, the
    usual case, answers without ``has_listeners``' locking and cache look-ups."""
    return bool(signal.receivers) and signal.has_listeners(sender)
