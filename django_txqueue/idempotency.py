"""Side effects that happen once: ``once(key)`` records an effect in the transaction of
its bookkeeping, so that a handler run twice (after a rescue) performs it once.

The record is a row with a unique key. A second run finds it committed and skips; a
run concurrent with the first waits on the first's uncommitted row (every database
makes a duplicate insert wait for the other transaction), then skips if it committed
and goes ahead if it rolled back. What the record cannot cover is the moment between
an external call and the commit: see docs/producing.md, "Side effects that happen once".
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from django.db import router, transaction

from . import conf, store
from .models import Effect
from .validation import validate_label


@contextmanager
def once(key: str, *, using: str | None = None) -> Iterator[bool]:
    """Open a transaction in which the effect ``key`` is recorded; yield True if this
    is its first record, False if one was committed before.

    The record commits with whatever the block writes and rolls back with it, an
    exception included. Nested in an outer transaction it joins that one (a savepoint).
    """
    if key is None:  # validate_label lets None through: an optional label elsewhere
        raise TypeError("the effect key must be a string, not None")
    validate_label(key, "the effect key")
    alias = using or conf.get("DATABASE") or router.db_for_write(Effect)
    with transaction.atomic(using=alias):
        yield store.record_effect(Effect, key, alias)
