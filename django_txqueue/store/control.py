"""What operators ask of items and queues: cancelling items, pausing and resuming
queues.
"""

from __future__ import annotations

from contextlib import suppress
from typing import TYPE_CHECKING, Any

from django.db import connections, models, transaction
from django.db.models import Case, F, Q, Value, When
from django.db.models.functions import Now

from ..db import dialect_for
from ..status import Status
from . import flows
from .conflicts import retrying_conflicts, update_retrying

if TYPE_CHECKING:
    from django.db.models import QuerySet

    from ..models import QueueItem


def cancel(items: QuerySet[Any]) -> int:
    """Cancel ``items`` (QueueItem's) in one UPDATE: the READY and WAITING ones end
    CANCELLED at once, finished now; the IN_PROGRESS ones not asked before get a
    cancellation request, which their handlers see with the next lease renewal
    (``cancel_requested()``) and which settles them CANCELLED. Finished items are left
    alone. Those that something waits for are cancelled in a transaction with what waits
    for them (``flows.end_waited_for``), after one look for them. Returns how many
    changed."""
    waiting = Q(status=Status.READY) | Q(status=Status.WAITING)
    asked = Q(status=Status.IN_PROGRESS, cancel_requested_at__isnull=True)
    # status last: MySQL assigns left to right, and finished_at reads the status as it was.
    changes = {
        "cancel_requested_at": Now(),
        "finished_at": Case(
            When(waiting, then=Now()),
            default=F("finished_at"),
            output_field=models.DateTimeField(),
        ),
        "status": Case(
            When(waiting, then=Value(int(Status.CANCELLED))),
            default=F("status"),
            output_field=models.PositiveSmallIntegerField(),
        ),
    }
    rows = items.order_by().filter(waiting | asked)
    ending_flows = waiting & Q(dependent_count__gt=0)
    changed = update_retrying(rows.exclude(ending_flows), **changes)
    waited_for = rows.filter(ending_flows)
    if not waited_for.exists():  # the usual case: no flow's item among them
        return changed
    return changed + retrying_conflicts(flows.end_waited_for, rows.db, waited_for, changes)


def cancel_item(item: QueueItem) -> bool:
    """``cancel`` of one item; if it changed, the instance's status, finish time and
    request time are read back (it may have been READY or IN_PROGRESS by then)."""
    alias = item._state.db or "default"
    one = type(item)._base_manager.using(alias).filter(pk=item.pk)
    if not cancel(one):
        return False
    with suppress(type(item).DoesNotExist):  # purged meanwhile: cancelled all the same
        item.refresh_from_db(using=alias, fields=["status", "finished_at", "cancel_requested_at"])
    return True


def pause(pauses: QuerySet[Any], queue: str) -> bool:
    """Give ``queue`` its row in ``pauses`` (the pause table, on its database): claims
    take none of its items from now on. False if it was paused already."""
    return retrying_conflicts(lambda: pauses.get_or_create(queue=queue)[1], pauses.db)


def resume(pauses: QuerySet[Any], queue: str) -> bool:
    """Delete ``queue``'s row from ``pauses`` and wake the consumers that wait for its
    work, in one transaction. False if it was not paused."""

    def run() -> bool:
        with transaction.atomic(using=pauses.db):
            resumed = int(pauses.filter(queue=queue).delete()[0]) > 0
            if resumed:
                dialect_for(pauses.db).announce(connections[pauses.db], queue)
            return resumed

    return retrying_conflicts(run, pauses.db)
