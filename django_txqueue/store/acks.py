"""Settling a claim: acknowledge (one item, or one claim's batch in one fenced UPDATE),
retry, fail, release. Each changes a row only while it is IN_PROGRESS under the claim's
token; a row whose cancellation was requested ends CANCELLED instead (``unless_cancelled``,
decided in the statement itself).
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.db import connections, models
from django.db.models import Case, F, Q, When
from django.db.models.functions import Now

from .. import conf
from ..db import dialect
from ..db.acks import Ack, ack_statement, claimed_dependents
from ..db.base import Uncounted
from ..db.rows import has_field
from ..status import Status, settled_as
from ..validation import check_json, to_timedelta
from . import backoff, flows
from .conflicts import retrying_conflicts, update_retrying

if TYPE_CHECKING:
    from django.db.models import Model, QuerySet

    from ..models import QueueItem, QueueModel

# Clears a claim, so that its holder's fenced acknowledgements change nothing.
UNCLAIMED: dict[str, Any] = {"pid": "", "claim_token": None, "lease_expires_at": None}


def ack(item: QueueModel, result: Any = None) -> bool:
    """Mark the item DONE (with ``result`` where the model keeps one), if this claim
    still holds it."""
    if has_field(type(item), "result"):
        check_json(result, "result")
    # _holds_no_claim(item), written out: so the type checker knows the token is set.
    if item.claim_token is None or item.status != Status.IN_PROGRESS:
        return False
    alias = item._state.db or "default"
    if not ack_many(
        type(item), alias, Ack(item.claim_token, {item.pk: result}, claimed_dependents([item]))
    ):
        return False
    mark_done(item, result)
    return True


def mark_done(item: QueueModel, result: Any = None) -> None:
    """Bring an acknowledged item's fields in line with its row: DONE, or CANCELLED if
    this instance knows of a cancellation request (one made after the last lease renewal
    read them settles the row CANCELLED too, but this instance still says DONE)."""
    item.status = known_status(item, Status.DONE)
    item.lease_expires_at = None
    if has_field(type(item), "result"):
        item.result = result  # type: ignore[attr-defined]
        item.__dict__.pop("finished_at", None)  # set by the database clock: load on access


def ack_many(model: type[Model], alias: str, ack: Ack) -> int:
    """Acknowledge, in one fenced UPDATE, ``ack``'s items of one claim: DONE with their
    results, or CANCELLED where a cancellation was requested meanwhile.

    Only rows still IN_PROGRESS under ``ack.claim_token`` change; returns how many did.
    """
    if not ack.results:
        return 0
    # InnoDB may pick an acknowledgement as a deadlock's victim (against an update_limit
    # claim, which locks as it reads), Galera refuse it against a claim of another node:
    # fenced, it is safe to run again.
    vendor = dialect(connections[alias])
    statement = ack_statement(model, alias)
    try:
        acknowledged = retrying_conflicts(vendor.acknowledge, alias, statement, ack)
    except Uncounted:  # rolled back: the plain statement, and flows' for the rest
        ack = replace(ack, dependents=None)
        acknowledged = retrying_conflicts(vendor.acknowledge, alias, statement, ack)
    return acknowledged + ack_waited_for(model, alias, ack, acknowledged)


def ack_waited_for(model: type[Model], alias: str, ack: Ack, acknowledged: int) -> int:
    """Acknowledge the items of ``ack`` that something waits for, which the statement that
    acknowledged ``acknowledged`` of them left alone, with what waits for them
    (``flows.end_waited_for``); how many. Nothing to do, and no query, when it took them all."""
    if acknowledged == len(ack.results) or not has_field(model, "dependent_count"):
        return 0
    held = model._base_manager.using(alias).filter(
        pk__in=list(ack.results),
        status=Status.IN_PROGRESS,
        claim_token=ack.claim_token,
        dependent_count__gt=0,
    )
    results = ack.results if has_field(model, "result") else None
    return retrying_conflicts(flows.end_waited_for, alias, held, flows.ACKNOWLEDGED, results)


def retry(
    item: QueueItem,
    error: str | None = None,
    delay: float | timedelta | None = None,
    *,
    error_class: str = "",
) -> bool:
    """Put the item back READY after ``delay`` (default: back-off with jitter), or FAILED
    once ``max_attempts`` claims have been spent."""
    if _holds_no_claim(item):
        # Before reading attempts: a release deferred them, and the row may be gone.
        return False
    if item.attempts >= item.max_attempts:
        return fail(item, error, error_class=error_class)
    if delay is not None:
        wait = to_timedelta(delay, "delay")
    else:
        wait = backoff.backoff(item.attempts, conf.get("RETRY_DELAY"), conf.get("RETRY_MAX_DELAY"))
    return _settle_if_held(
        item,
        Status.READY,
        **UNCLAIMED,
        run_at=now_plus(wait),
        last_error=error or "",
        error_class=error_class,
    )


def snooze(item: QueueItem, seconds: float) -> bool:
    """Put the item back READY to run in ``seconds`` without counting the attempt (as
    ``release``, CANCELLED instead if its cancellation was requested), one more of its
    ``snoozes``; past its queue's ``MAX_SNOOZES``, a ``retry`` after ``seconds`` that
    counts it, so that nothing snoozes forever."""
    if _holds_no_claim(item):
        return False
    wait = timedelta(seconds=seconds)
    limit = conf.queue_option(item.queue, "MAX_SNOOZES")
    if item.snoozes >= limit:
        error = f"snoozed {item.snoozes} times, the queue's MAX_SNOOZES; this one is an attempt"
        return retry(item, error, wait, error_class="django_txqueue.Snooze")
    changes = {**UNCLAIMED, "run_at": now_plus(wait), "snoozes": F("snoozes") + 1}
    return _settle_if_held(item, Status.READY, attempts=F("attempts") - 1, **changes)


def fail(item: QueueModel, error: str | None = None, *, error_class: str = "") -> bool:
    """Mark the item FAILED (keeping ``error`` where the model has room for it)."""
    if not has_field(type(item), "last_error"):
        return _change_if_held(item, status=Status.FAILED, lease_expires_at=None)
    return _settle_if_held(
        item,
        Status.FAILED,
        finished_at=Now(),
        last_error=error or "",
        error_class=error_class,
        lease_expires_at=None,
    )


def release(item: QueueModel) -> bool:
    """Put the item back READY without counting the attempt (CANCELLED instead if its
    cancellation was requested: it is not to run again)."""
    return _settle_if_held(item, Status.READY, attempts=F("attempts") - 1, **UNCLAIMED)


def unclaim(model: type[Model], using: str, pks: list[Any], token: int) -> int:
    """Give back items a claim took, in the claim's own transaction (over a key's rate
    budget): READY again, their attempt uncounted."""
    rows = model._base_manager.using(using).filter(pk__in=pks, claim_token=token)
    return int(rows.update(status=Status.READY, attempts=F("attempts") - 1, **UNCLAIMED))


def unless_cancelled(
    model: type[Model], status: int, *, finished_at: Any = None
) -> dict[str, Any]:
    """The changes that settle a held item in ``status`` (``finished_at`` with it, where
    the model keeps one), or in CANCELLED, finished now, if its cancellation was requested:
    decided in the UPDATE itself, from the row. A model without ``cancel_requested_at``
    (a plain QueueModel) just takes ``status``."""
    if not has_field(model, "cancel_requested_at"):
        return (
            {"status": status}
            if finished_at is None
            else {"status": status, "finished_at": finished_at}
        )
    requested = Q(cancel_requested_at__isnull=False)
    # finished_at first: MySQL assigns left to right, and neither reads status anyway.
    return {
        "finished_at": Case(
            When(requested, then=Now()),
            default=finished_at if finished_at is not None else F("finished_at"),
            output_field=models.DateTimeField(),
        ),
        "status": settled_as(status),
    }


def known_status(item: QueueModel, status: int) -> int:
    """What a settled instance says of itself: CANCELLED if it knew of a cancellation
    request (read with its last lease renewal), else ``status``. The row, which decided
    with ``settled_as``, is the truth: a request made since settles it CANCELLED too."""
    requested = item.__dict__.get("cancel_requested_at") is not None  # no query if deferred
    return Status.CANCELLED if requested else status


def _holds_no_claim(item: QueueModel) -> bool:
    """Whether the item, as this process holds it, has no claim to settle: never claimed,
    or settled already through it. No query: the row may be settled (or purged) too."""
    return item.claim_token is None or item.status != Status.IN_PROGRESS


def _settle_if_held(
    item: QueueModel, status: int, *, finished_at: Any = None, **changes: Any
) -> bool:
    """``_change_if_held`` into ``status``, or CANCELLED if the row's cancellation was
    requested (``unless_cancelled``). The instance then says what it knows: CANCELLED if
    it knew of the request, else ``status``; the row, which decided, is the truth."""
    settled = unless_cancelled(type(item), status, finished_at=finished_at)
    if not _change_if_held(item, **changes, **settled):
        return False
    item.status = known_status(item, status)
    if item.status == status and finished_at is None and has_field(type(item), "finished_at"):
        item.finished_at = None  # type: ignore[attr-defined]  # not finished, as it knows
    return True


def _change_if_held(item: QueueModel, **changes: Any) -> bool:
    """Apply ``changes`` only if the row is still IN_PROGRESS under this item's claim; an
    item something waits for in a transaction with what its end releases or cancels."""
    if _holds_no_claim(item):
        return False
    held: QuerySet[Any] = (
        type(item)
        ._base_manager.using(item._state.db or "default")
        .filter(pk=item.pk, status=Status.IN_PROGRESS, claim_token=item.claim_token)
    )
    if not has_field(type(item), "dependent_count"):
        changed = update_retrying(held, **changes)
    else:
        changed = update_retrying(held.filter(dependent_count=0), **changes)
        if not changed:  # taken over, or waited for
            waited_for = held.filter(dependent_count__gt=0)
            changed = retrying_conflicts(flows.end_waited_for, held.db, waited_for, changes)
    if changed:
        for name, value in changes.items():
            setattr(item, name, value)
        defer_computed(item)
    return bool(changed)


def now_plus(wait: timedelta) -> Any:
    """The database clock plus ``wait``, as an expression.

    A zero wait is plain ``Now()``: SQLite's arithmetic result has microsecond digits
    that its millisecond ``Now()`` would compare as later, within the same millisecond.
    """
    return Now() + wait if wait else Now()


def defer_computed(instance: Model) -> None:
    """Fields still holding an expression (the database computed their value and did not
    return it) become deferred: Django loads them on first access."""
    for field in instance._meta.concrete_fields:
        if hasattr(instance.__dict__.get(field.attname), "resolve_expression"):
            del instance.__dict__[field.attname]
