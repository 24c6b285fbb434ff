"""A queue's bound row (``QueueBound``): the lock a bounded queue's producers take before
they count its unfinished items (``MAX_SIZE``), and a capped queue's claims before they
count its running ones (``MAX_IN_FLIGHT``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.utils import timezone

from ..db import dialect_for

if TYPE_CHECKING:
    from django.db.models import Model


def lock_bound(bounds: type[Model], queue: str, using: str) -> None:
    """Create ``queue``'s row of ``bounds``, or lock it if it exists, in one statement.

    An upsert rather than "SELECT ... FOR UPDATE, INSERT if missing": producers racing
    to create the row would otherwise hold shared locks on InnoDB (INSERT IGNORE) and
    deadlock upgrading them, and on SQLite it takes the writer lock at once, before the
    count.
    """
    bounds._default_manager.using(using).bulk_create(
        [bounds(queue=queue, locked_at=timezone.now())],
        update_conflicts=True,
        unique_fields=dialect_for(using).upsert_target(["queue"]),
        update_fields=["locked_at"],
    )
