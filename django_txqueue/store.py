"""Every state change of queue items and consumers, one function per intent.

Nothing else in the package writes queue rows. Each change after a claim is fenced:
it names the claim token it expects and only touches a row still IN_PROGRESS under
it, so a consumer whose claim was taken over changes nothing and learns so from the
return value. Functions take the items, querysets or models to act on, so this module
works for any ``QueueModel`` and imports no models itself.
"""

from __future__ import annotations

import os
import random
import secrets
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from django.db import IntegrityError, OperationalError, connections, models, transaction
from django.db.models import Case, F, Q, Value, When
from django.db.models.functions import Now

from . import conf
from . import retry as backoff
from .db import dialect, dialect_for
from .db.compiler import ClaimStatement, ClaimValues, ack_sql, has_field, sort_items
from .db.inserts import inserts
from .status import FINISHED, Status
from .validation import check_json, to_timedelta, validate_pid

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.db.models import Model, QuerySet

    from .models import Consumer, QueueItem, QueueModel

T = TypeVar("T")
# A deadlock or lock-wait timeout (MySQL), or a busy SQLite file past its timeout, is
# retried this many times with a short jittered pause before it reaches the caller.
TRANSIENT_RETRIES = 5
# Attempts at inserting a dedup_key item whose unfinished twin finishes meanwhile.
DEDUP_INSERT_ATTEMPTS = 3
PURGE_BATCH = 1000
# The lock that lets one consumer at a time purge a database's finished items.
PURGE_LOCK = "txqueue_purge"
# Clears a claim, so that its holder's fenced acknowledgements change nothing.
UNCLAIMED: dict[str, Any] = {"pid": "", "claim_token": None, "lease_expires_at": None}


# -- identities ----------------------------------------------------------------------


def new_identity() -> str:
    """A consumer identity, ``host:os-pid:random``, never issued before.

    The random part makes a restarted container (same host name, same pid 1) a new
    consumer, so its predecessor's items are recognisably orphaned.
    """
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


class ConsumerIdentity:
    """This process's default identity for claims, new after a fork."""

    _value: ClassVar[str | None] = None

    @classmethod
    def get(cls) -> str:
        if cls._value is None:
            cls._value = new_identity()
        return cls._value

    @classmethod
    def reset(cls) -> None:
        cls._value = None


os.register_at_fork(after_in_child=ConsumerIdentity.reset)


def consumer_identity() -> str:
    """The default ``pid`` that claims by this process write on items."""
    return ConsumerIdentity.get()


# -- producing -----------------------------------------------------------------------


def insert(item: QueueItem, using: str) -> QueueItem:
    inserts(type(item), using).insert([item])
    return item


def insert_many(
    items: list[QueueItem], using: str, varying: Sequence[str] | None = None
) -> list[QueueItem]:
    """One INSERT per batch, all or none. ``varying``: the only fields whose values
    differ between the items, if known."""
    inserts(type(items[0]), using).insert(items, varying=varying)
    return items


def insert_unique(item: QueueItem, using: str) -> QueueItem:
    """Insert, or return the unfinished item of the same queue holding the same dedup_key.

    The unique index on (queue, active_dedup_key) decides races between producers;
    the savepoint keeps the caller's transaction usable after a conflict.
    """
    twins = (
        type(item)
        ._default_manager.using(using)
        .filter(queue=item.queue, active_dedup_key=item.dedup_key)
    )
    for _ in range(DEDUP_INSERT_ATTEMPTS):
        try:
            with transaction.atomic(using=using):
                return insert(item, using)
        except IntegrityError:
            holder = twins.first()
            if holder is not None:
                return holder
    raise IntegrityError(
        f"could not enqueue dedup_key {item.dedup_key!r} on queue {item.queue!r}: "
        "its unfinished twin kept changing"
    )


# -- claiming ------------------------------------------------------------------------


def claim(
    statement: ClaimStatement,
    *,
    pid: str | None = None,
    strategy: str = "auto",
    lease: float | timedelta | None = None,
    after: tuple[Any, ...] | None = None,
) -> list[Any]:
    """Move up to ``statement.limit`` ready items to IN_PROGRESS under a new claim.

    ``lease`` None gives each item its queue's ``LEASE``. The strategy is resolved
    here, once per claim, from the caller's choice, the setting and the database.
    ``after``: only items that sort after it (``ClaimValues.after``).
    """
    values = claim_values(pid, lease, after)
    connection, dialect = statement.connection, statement.dialect
    resolved = dialect.resolve_strategy(strategy, connection)
    items = _retrying_lock_conflicts(
        lambda: dialect.claim(resolved, statement, values), statement.connection
    )
    return sort_items(items, statement.order)


def claim_values(
    pid: str | None, lease: float | timedelta | None, after: tuple[Any, ...] | None = None
) -> ClaimValues:
    """A new claim's pid (the caller's, checked, or this process's), fencing token,
    lease (None: each item's queue's) and where it starts."""
    validate_pid(pid)
    duration = None if lease is None else to_timedelta(lease, "lease")
    return ClaimValues(pid or consumer_identity(), secrets.randbits(63), duration, after)


def _retrying_lock_conflicts(run: Callable[[], T], connection: BaseDatabaseWrapper) -> T:
    """Run ``run``, retrying the vendor's transient lock errors with a short jittered pause.

    Inside the caller's transaction the failed statement may have rolled the whole
    transaction back: only the caller can retry that.
    """
    owns_transaction = not connection.in_atomic_block
    for attempt in range(TRANSIENT_RETRIES):
        try:
            return run()
        except OperationalError as exc:
            if not owns_transaction or not dialect(connection).is_transient(exc):
                raise
            time.sleep(random.uniform(0.005, 0.02) * 2**attempt)
    return run()


# -- settling a claim ----------------------------------------------------------------


def ack(item: QueueModel, result: Any = None) -> bool:
    """Mark the item DONE (with ``result`` where the model keeps one), if this claim
    still holds it."""
    if has_field(type(item), "result"):
        check_json(result, "result")
    # _settled(item), written out so that the type checker knows the token is set.
    if item.claim_token is None or item.status != Status.IN_PROGRESS:
        return False
    if not ack_many(type(item), item._state.db or "default", item.claim_token, {item.pk: result}):
        return False
    mark_done(item, result)
    return True


def mark_done(item: QueueModel, result: Any = None) -> None:
    """Bring an acknowledged item's fields in line with its row."""
    item.status, item.lease_expires_at = Status.DONE, None
    if has_field(type(item), "result"):
        item.result = result  # type: ignore[attr-defined]
        item.__dict__.pop("finished_at", None)  # set by the database clock: load on access


def ack_many(model: type[Model], alias: str, claim_token: int, results: dict[Any, Any]) -> int:
    """Mark DONE, in one fenced UPDATE, items of one claim: ``{pk: result}``.

    Only rows still IN_PROGRESS under ``claim_token`` change; returns how many did.
    """
    if not results:
        return 0
    connection = connections[alias]
    sql, params = ack_statement(model, alias, claim_token, results)

    def run() -> int:
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            return int(cursor.rowcount)

    # InnoDB may pick an acknowledgement as a deadlock's victim (against an update_limit
    # claim, which locks as it reads): fenced, it is safe to run again.
    return _retrying_lock_conflicts(run, connection)


def ack_statement(
    model: type[Model], alias: str, claim_token: int, results: dict[Any, Any]
) -> tuple[str, list[Any]]:
    """``ack_many``'s UPDATE and its parameters."""
    connection = connections[alias]
    with_results = any(value is not None for value in results.values())
    # Plain ints: mysqlclient would quote a Status member as a string.
    params: list[Any] = [int(Status.DONE)]
    if with_results:
        field: Any = model._meta.get_field("result")
        for pk, value in results.items():
            params += [pk, field.get_db_prep_save(value, connection)]
    params += [*dialect(connection).pk_params(list(results)), int(Status.IN_PROGRESS), claim_token]
    return ack_sql(model, connection, len(results), with_results), params


def ack_and_claim(
    statement: ClaimStatement,
    claim_token: int,
    results: dict[Any, Any],
    *,
    pid: str | None = None,
    strategy: str = "auto",
    lease: float | timedelta | None = None,
    after: tuple[Any, ...] | None = None,
) -> tuple[int, list[Any]]:
    """``ack_many`` of one claim's items, then ``claim``: together where the database
    can (skip_locked: one statement on PostgreSQL, one transaction on MySQL and
    MariaDB), else one after the other. Returns the number acknowledged and the
    claimed items."""
    connection, dialect = statement.connection, statement.dialect
    resolved = dialect.resolve_strategy(strategy, connection)
    if not (results and resolved == "skip_locked" and dialect.acks_while_claiming):
        acked = ack_many(statement.model, statement.alias, claim_token, results)
        return acked, claim(statement, pid=pid, strategy=resolved, lease=lease, after=after)
    values = claim_values(pid, lease, after)
    ack = ack_statement(statement.model, statement.alias, claim_token, results)
    acked, items = _retrying_lock_conflicts(
        lambda: dialect.ack_and_claim(statement, values, ack), statement.connection
    )
    return acked, sort_items(items, statement.order)


def retry(
    item: QueueItem,
    error: str | None = None,
    delay: float | timedelta | None = None,
    *,
    error_class: str = "",
) -> bool:
    """Put the item back READY after ``delay`` (default: back-off with jitter), or FAILED
    once ``max_attempts`` claims have been spent."""
    if _settled(item):
        # Before reading attempts: a release deferred them, and the row may be gone.
        return False
    if item.attempts >= item.max_attempts:
        return fail(item, error, error_class=error_class)
    if delay is not None:
        wait = to_timedelta(delay, "delay")
    else:
        wait = backoff.backoff(item.attempts, conf.get("RETRY_DELAY"), conf.get("RETRY_MAX_DELAY"))
    return _settle(
        item,
        **UNCLAIMED,
        status=Status.READY,
        run_at=now_plus(wait),
        last_error=error or "",
        error_class=error_class,
    )


def fail(item: QueueModel, error: str | None = None, *, error_class: str = "") -> bool:
    """Mark the item FAILED (keeping ``error`` where the model has room for it)."""
    if not has_field(type(item), "last_error"):
        return _settle(item, status=Status.FAILED, lease_expires_at=None)
    return _settle(
        item,
        status=Status.FAILED,
        last_error=error or "",
        error_class=error_class,
        finished_at=Now(),
        lease_expires_at=None,
    )


def release(item: QueueModel) -> bool:
    """Put the item back READY without counting the attempt."""
    return _settle(item, status=Status.READY, attempts=F("attempts") - 1, **UNCLAIMED)


def _settled(item: QueueModel) -> bool:
    """Whether the item, as this process holds it, has no claim to settle: never claimed,
    or settled already through it. No query: the row may be settled (or purged) too."""
    return item.claim_token is None or item.status != Status.IN_PROGRESS


def _settle(item: QueueModel, **changes: Any) -> bool:
    """Apply ``changes`` only if the row is still IN_PROGRESS under this item's claim."""
    if _settled(item):
        return False
    changed = (
        type(item)
        ._base_manager.using(item._state.db)
        .filter(pk=item.pk, status=Status.IN_PROGRESS, claim_token=item.claim_token)
        .update(**changes)
    )
    if changed:
        for name, value in changes.items():
            setattr(item, name, value)
        defer_computed(item)
    return bool(changed)


# -- leases and rescue ---------------------------------------------------------------


def renew_leases(model: type[Model], alias: str, tokens: dict[Any, int], lease: timedelta) -> int:
    """Push the leases of in-flight items ``{pk: claim_token}`` to now + ``lease``."""
    if not tokens:
        return 0
    held = Q()
    for pk, token in tokens.items():
        held |= Q(pk=pk, claim_token=token)
    return (
        model._base_manager.using(alias)
        .filter(held, status=Status.IN_PROGRESS)
        .update(lease_expires_at=Now() + lease)
    )


def rescue(stuck: QuerySet[Any], *, fail: bool = False) -> int:
    """Stuck items go back to READY, or FAILED when their attempts are spent.

    ``fail=True`` fails them all at once, for work that must never run twice. A model
    without ``max_attempts`` (a plain QueueModel) always goes back to READY.
    """
    if not has_field(stuck.model, "max_attempts"):
        return stuck.update(**UNCLAIMED, status=Status.READY)
    failing = Q(pk__isnull=False) if fail else Q(attempts__gte=F("max_attempts"))
    reason = "stuck: lease expired or consumer died" + ("" if fail else ", attempts spent")
    return stuck.update(
        **UNCLAIMED,
        status=Case(When(failing, then=Value(Status.FAILED)), default=Value(Status.READY)),
        finished_at=Case(
            When(failing, then=Now()), default=None, output_field=models.DateTimeField()
        ),
        last_error=Case(
            When(failing, then=Value(reason)),
            default=F("last_error"),
            output_field=models.TextField(),
        ),
        error_class=Case(
            When(failing, then=Value("")),
            default=F("error_class"),
            output_field=models.CharField(),
        ),
    )


def requeue(items: QuerySet[Any], *, stuck: Q) -> int:
    """Put ``items`` back READY, due now, attempts and last error kept: the READY and
    FAILED ones, and those matching ``stuck``, all checked in the UPDATE itself, so an item
    that started running meanwhile under a live consumer is left alone. For QueueItem.

    A FAILED item whose dedup_key an unfinished item holds stays FAILED (the unique index
    refuses it): FAILED items with a dedup_key go one by one, so one refusal stops no other.
    """
    allowed = items.order_by().filter(Q(status__in=(Status.READY, Status.FAILED)) | stuck)
    changes = {**UNCLAIMED, "status": Status.READY, "run_at": Now(), "finished_at": None}
    changed = allowed.exclude(status=Status.FAILED, dedup_key__isnull=False).update(**changes)
    holding_keys = allowed.filter(status=Status.FAILED, dedup_key__isnull=False)
    for pk in list(holding_keys.values_list("pk", flat=True)):
        try:
            with transaction.atomic(using=items.db):
                changed += holding_keys.filter(pk=pk).update(**changes)
        except IntegrityError:
            pass
    return changed


def fail_many(items: QuerySet[Any], *, stuck: Q, error: str) -> int:
    """Mark FAILED with ``error`` the READY ``items`` and those matching ``stuck``, checked in
    the UPDATE itself; a running item under a live consumer is left alone. For QueueItem."""
    return (
        items.order_by()
        .filter(Q(status=Status.READY) | stuck)
        .update(
            **UNCLAIMED,
            status=Status.FAILED,
            finished_at=Now(),
            last_error=error,
            error_class="",
        )
    )


def delete_finished(items: QuerySet[Any]) -> int:
    """Delete the DONE and FAILED ``items``; returns how many."""
    return int(items.order_by().filter(status__in=FINISHED).delete()[0])


def release_lost(
    model: type[Model], alias: str, pid: str, held: Iterable[Any], claimed_before: timedelta
) -> int:
    """Put back READY, attempt not counted, the items ``pid`` claimed over
    ``claimed_before`` ago and does not hold: claims whose answer never reached it (the
    connection broke after the server committed). Without this they would wait out a
    whole lease under a consumer that is alive and renewing nothing for them."""
    return (
        model._base_manager.using(alias)
        .filter(status=Status.IN_PROGRESS, pid=pid, claimed_at__lt=Now() - claimed_before)
        .exclude(pk__in=list(held))
        .update(status=Status.READY, attempts=F("attempts") - 1, **UNCLAIMED)
    )


def purge(items: QuerySet[Any], older_than: timedelta, *, until: float | None = None) -> int:
    """Delete DONE and FAILED ``items`` finished over ``older_than`` ago, in small batches.

    Each batch is its own short statement, so a purge of millions of rows never holds
    locks for long. Returns how many were deleted.
    """
    finished = items.filter(status__in=FINISHED, finished_at__lt=Now() - older_than)
    return delete_in_batches(finished, until=until)


def purge_effects(
    effects: QuerySet[Any], older_than: timedelta, *, until: float | None = None
) -> int:
    """Delete ``once`` records made over ``older_than`` ago, in small batches."""
    return delete_in_batches(effects.filter(recorded_at__lt=Now() - older_than), until=until)


def delete_in_batches(rows: QuerySet[Any], *, until: float | None = None) -> int:
    """Delete ``rows`` a batch of PURGE_BATCH primary keys at a time; how many were deleted.

    With ``until`` (a ``time.monotonic()`` instant) it stops after the batch that reaches
    it (always doing one, so that it makes progress), leaving the rest for later.
    """
    deleted, after = 0, 0
    while True:
        batch = list(
            rows.filter(pk__gt=after).order_by("pk").values_list("pk", flat=True)[:PURGE_BATCH]
        )
        if not batch:
            return deleted
        deleted += int(rows.filter(pk__in=batch).delete()[0])
        after = batch[-1]
        if until is not None and time.monotonic() >= until:
            return deleted


def try_lock(alias: str, name: str) -> AbstractContextManager[bool]:
    """Hold the lock ``name`` of database ``alias`` if nobody does, without waiting;
    yields whether it is held (``Dialect.try_lock``)."""
    return dialect_for(alias).try_lock(connections[alias], name)


# -- consumers -----------------------------------------------------------------------


def register(consumer: Consumer, using: str) -> Consumer:
    """Insert the Consumer row of a starting consumer."""
    consumer.save(force_insert=True, using=using)
    return consumer


def beat(consumer: Consumer, *, processed: int, failed: int, queues: list[str]) -> None:
    """Heartbeat: the consumer is alive (database clock), with its counters and the queues
    it serves now (it may find new ones)."""
    _consumer_row(consumer).update(
        last_heartbeat_at=Now(), processed=processed, failed=failed, queues=queues
    )


def stop(consumer: Consumer, *, processed: int, failed: int) -> None:
    """Mark the consumer stopped: its unfinished items are stuck from now on."""
    _consumer_row(consumer).update(stopped_at=Now(), processed=processed, failed=failed)


def _consumer_row(consumer: Consumer) -> QuerySet[Any]:
    return type(consumer)._default_manager.using(consumer._state.db).filter(pk=consumer.pk)


# -- helpers -------------------------------------------------------------------------


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
