"""Signals for users' metrics. Sent by the consumer, with ``sender`` the QueueItem class.

- ``item_claimed(item=...)``: a consumer claimed the item and is about to run it.
- ``item_done(item=..., result=..., duration=...)``: the handler returned; acknowledged.
- ``item_failed(item=..., error=..., will_retry=..., duration=...)``: the handler raised.
"""

from django.dispatch import Signal

item_claimed = Signal()
item_done = Signal()
item_failed = Signal()
