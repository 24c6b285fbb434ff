"""A transaction of the store's own refused by a conflict (a deadlock, a Galera
certification failure, a serialization failure, a lock-wait timeout, a busy SQLite file)
runs again: it wrote nothing, so no attempt is counted.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from django.db import DatabaseError, connections

from ..db import dialect

if TYPE_CHECKING:
    from django.db.models import QuerySet


T = TypeVar("T")

# A refused transaction (``Dialect.is_transient``) runs again this many times, after a
# short jittered pause, before the error reaches the caller. Ten: on a Galera cluster
# consumers of every node claim from the same head of a queue, and a claim may lose
# several races in a row (docs/scaling.md); the pauses add up to about 2 s at most. A
# claim that loses them all claims nothing this turn.
TRANSIENT_RETRIES = 10


def retrying_conflicts(
    run: Callable[..., T], using: str, *args: Any, retries: int = TRANSIENT_RETRIES
) -> T:
    """``run(*args)``, a transaction of its own on ``using`` (one statement in autocommit,
    or an atomic block inside ``run``), run again up to ``retries`` times with a short
    jittered pause while a conflict refuses it (``Dialect.is_transient``).

    Inside the caller's transaction it runs once: the conflict rolled the caller's whole
    transaction back (Galera aborts it all), so only the caller can run it again
    (``run_in_transaction``).
    """
    connection = connections[using]
    if connection.in_atomic_block:
        return run(*args)
    for attempt in range(retries):
        try:
            return run(*args)
        except DatabaseError as exc:
            if not dialect(connection).is_transient(exc) or connection.in_atomic_block:
                raise
            time.sleep(random.uniform(0.005, 0.02) * 2 ** min(attempt, 4))
    return run(*args)


def update_retrying(rows: QuerySet[Any], **changes: Any) -> int:
    """``rows.update(**changes)``, a transaction of its own run again on a conflict
    (``retrying_conflicts``); how many rows changed."""
    return retrying_conflicts(lambda: int(rows.update(**changes)), rows.db)


def delete_retrying(rows: QuerySet[Any]) -> int:
    """``rows.delete()``, run again on a conflict as ``update_retrying``; how many went."""
    return retrying_conflicts(lambda: int(rows.delete()[0]), rows.db)
