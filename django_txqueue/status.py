"""The states of a queue item, and the rule that settles a held one. Its own module so
that ``store`` and ``db`` can name them without importing the models."""

from django.db import models


class Status(models.IntegerChoices):
    """An item's state; the integer is what the ``status`` column holds.

    READY, IN_PROGRESS and WAITING are unfinished (they count towards ``MAX_SIZE`` and
    hold their ``dedup_key``); DONE, FAILED and CANCELLED are finished, and purged after
    ``RETENTION``.
    """

    READY = 1, "ready"
    IN_PROGRESS = 2, "in progress"
    DONE = 3, "done"
    FAILED = 4, "failed"
    # Cancelled before it ran, or by a handler that returned after a cancellation request.
    CANCELLED = 5, "cancelled"
    # Enqueued with ``after=``: never claimed; READY once the items it waits for are done
    # (docs/flows.md).
    WAITING = 6, "waiting"


# The states an item can still leave: it counts towards MAX_SIZE and holds its dedup_key.
UNFINISHED = (Status.READY, Status.IN_PROGRESS, Status.WAITING)
FINISHED = (Status.DONE, Status.FAILED, Status.CANCELLED)


def settled_as(status: int) -> models.Case:
    """``status``, or CANCELLED where the row's cancellation was requested: the rule that
    settles a held item, decided from the row in the statement that settles it. Written
    once: the store's updates use it, and the acknowledgement's SQL is compiled from it
    (``db.acks.AckStatement``)."""
    return models.Case(
        models.When(cancel_requested_at__isnull=False, then=models.Value(int(Status.CANCELLED))),
        default=models.Value(int(status)),
        output_field=models.PositiveSmallIntegerField(),
    )
