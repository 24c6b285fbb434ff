"""Every state change of queue items and consumers, one function per intent.

Nothing else in the package writes queue rows. Each change after a claim is fenced:
it names the claim token it expects and only touches a row still IN_PROGRESS under
it, so a consumer whose claim was taken over changes nothing and learns so from the
return value. Functions take the items, querysets or models to act on, so this module
works for any ``QueueModel`` and imports no models itself.
"""

from __future__ import annotations

import operator
import os
import random
import secrets
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, suppress
from datetime import datetime, timedelta
from functools import partial, reduce
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from django.db import DatabaseError, IntegrityError, connections, models, transaction
from django.db.models import Case, F, Q, Value, When
from django.db.models.functions import Now
from django.utils import timezone

from . import conf
from . import retry as backoff
from .db import dialect, dialect_for
from .db.compiler import ClaimStatement, ClaimValues, sort_items
from .db.inserts import insert_or_ignore, inserts
from .db.rows import has_field
from .exceptions import QueueFull
from .status import FINISHED, Status
from .validation import check_json, to_timedelta, validate_pid

if TYPE_CHECKING:
    from django.db.models import Model, QuerySet

    from .models import Consumer, QueueItem, QueueModel

T = TypeVar("T")
# A transaction of the library's own refused by a conflict (``Dialect.is_transient``: a
# deadlock, a Galera certification failure, a serialization failure, a lock-wait timeout,
# a busy SQLite file) runs again this many times, after a short jittered pause, before
# the error reaches the caller. It wrote nothing, so no attempt is counted.
# Ten: on a Galera cluster consumers of every node claim from the same head of a queue,
# and a claim may lose several races in a row (docs/scaling.md); the pauses add
# up to about 2 s at most. A claim that loses them all claims nothing this turn.
TRANSIENT_RETRIES = 10
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


def enqueue(
    items: list[QueueItem],
    using: str,
    *,
    bound: tuple[int, type[Model]] | None = None,
    varying: Sequence[str] | None = None,
) -> list[QueueItem]:
    """Insert new items of one queue in the caller's transaction, all or none.

    One item with a ``dedup_key`` gives way to its unfinished twin, which is returned in
    its place. With ``bound``, the queue's size limit and the model of its bound row,
    the queue's unfinished items are counted under that row's lock first, and
    ``QueueFull`` is raised having written nothing when the items do not fit.
    ``varying``: the only fields whose values differ between the items, if known (the
    INSERT converts the others once). Outside a caller's transaction the enqueue is a
    transaction of its own, run again when a conflict refuses it.
    """
    return retrying_conflicts(lambda: _enqueue(items, using, bound, varying), using)


def _enqueue(
    items: list[QueueItem],
    using: str,
    bound: tuple[int, type[Model]] | None,
    varying: Sequence[str] | None,
) -> list[QueueItem]:
    if bound is not None:
        max_size, bounds = bound
        # savepoint=False: inside the caller's transaction it adds no query, and outside
        # one the lock, the count and the insert still share a transaction of their own.
        with transaction.atomic(using=using, savepoint=False):
            current = lock_and_count(items[0], bounds, using)
            if current + len(items) <= max_size:
                return insert_new(items, using, varying)
            # A full queue still answers with the unfinished twin: it adds nothing.
            twin = unfinished_twin(items[0], using) if len(items) == 1 else None
            if twin is not None:
                return [twin]
        # Raised outside the block, which would otherwise doom the caller's transaction.
        raise QueueFull(items[0], current)
    return insert_new(items, using, varying)


def unfinished_twin(item: QueueItem, using: str) -> QueueItem | None:
    """The unfinished item of ``item``'s queue that holds its dedup_key, if any."""
    if item.dedup_key is None:
        return None
    twins = type(item)._default_manager.using(using)
    found: QueueItem | None = twins.filter(
        active_dedup_queue=item.queue, active_dedup_key=item.dedup_key
    ).first()
    return found


def lock_and_count(item: QueueItem, bounds: type[Model], using: str) -> int:
    """Lock the bound row of ``item``'s queue, then count the queue's unfinished items.

    The lock is held until the caller's transaction ends, so the count stays true until
    its insert commits: producers of this queue take turns, whatever the database. Only
    enqueues add unfinished items, and they all take this lock first; consumers
    finishing items only lower the count and need no lock. Lock order is always the
    bound row, then items; a claim never takes the bound row.
    """
    lock_bound(bounds, item.queue, using)
    # An OR of equalities, which PostgreSQL matches to the partial indexes (not so IN).
    unfinished = Q(status=Status.READY) | Q(status=Status.IN_PROGRESS)
    items = type(item)._default_manager.using(using).filter(unfinished, queue=item.queue)
    return int(items.count())


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


def insert_new(
    items: list[QueueItem], using: str, varying: Sequence[str] | None = None
) -> list[QueueItem]:
    """Insert the items: one with a dedup_key gives way to its unfinished twin."""
    if len(items) == 1 and items[0].dedup_key is not None:
        return [insert_unique(items[0], using)]
    return insert_many(items, using, varying)


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

    The unique index on (active_dedup_queue, active_dedup_key) decides races between
    producers; the savepoint keeps the caller's transaction usable after a conflict.
    """
    for _ in range(DEDUP_INSERT_ATTEMPTS):
        try:
            with transaction.atomic(using=using):
                return insert(item, using)
        except IntegrityError:
            holder = unfinished_twin(item, using)
            if holder is not None:
                return holder
    raise IntegrityError(
        f"could not enqueue dedup_key {item.dedup_key!r} on queue {item.queue!r}: "
        "its unfinished twin kept changing"
    )


def record_effect(model: type[Model], key: str, using: str) -> bool:
    """Record the effect ``key`` in the caller's transaction: True if this is its first
    record, False if one was committed before (``once``). A savepoint of its own, so
    that a duplicate key leaves the caller's transaction usable."""
    try:
        with transaction.atomic(using=using):
            model._default_manager.using(using).create(key=key)
    except IntegrityError:
        return False
    return True


# -- periodic items ------------------------------------------------------------------


def enqueue_tick(
    ticks: type[Model], name: str, tick: datetime, using: str, enqueue: Callable[[], Any]
) -> Any | None:
    """Record tick ``tick`` of schedule entry ``name`` and, if this call recorded it,
    ``enqueue()`` its item (returning its primary key), in one transaction on ``using``:
    the item exists exactly when its tick row does. Returns that key, or None when another
    consumer had the tick.

    The unique (name, tick) decides between consumers: an insert that would break it is
    ignored (``insert_or_ignore``), so losing consumers log no error anywhere, and one
    whose rival has not committed yet waits for it (row locks; SQLite's one writer) and
    then finds the tick taken. A transaction refused by a conflict (Galera certifies
    one of two nodes' rows) runs again, and then finds it taken too.
    """

    def run() -> Any | None:
        with transaction.atomic(using=using):
            if not insert_or_ignore(ticks(name=name, tick=tick), ["name", "tick"], using):
                return None
            pk = enqueue()
            ticks._default_manager.using(using).filter(name=name, tick=tick).update(item_id=pk)
            return pk

    return retrying_conflicts(run, using)


def trim_ticks(ticks: type[Model], name: str, before: datetime, using: str) -> int:
    """Delete schedule entry ``name``'s tick rows older than ``before``; how many went."""
    return delete_retrying(ticks._default_manager.using(using).filter(name=name, tick__lt=before))


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

    The strategy and the lease are resolved here, once per claim: the strategy from the
    caller's choice, the setting and the database; ``lease`` None gives each item its
    queue's ``LEASE``. ``after``: only items that sort after it (``ClaimValues.after``).
    Outside a caller's transaction a claim that lost a race runs again; one that loses
    ``TRANSIENT_RETRIES`` races in a row claims nothing.
    """
    values = claim_values(statement, pid, lease, after)
    vendor = dialect(statement.connection)
    resolved = vendor.resolve_strategy(strategy, statement.connection)
    # Lost a race (a deadlock, or on Galera another node's claim of the same rows
    # certified first): nothing was claimed, so claim again.
    try:
        items = retrying_conflicts(
            lambda: vendor.claim(resolved, statement, values), statement.alias
        )
    except DatabaseError as exc:
        if statement.connection.in_atomic_block or not vendor.is_transient(exc):
            raise
        return []  # lost every race this turn: the caller claims again
    return sort_items(items, statement.order)


def claim_values(
    statement: ClaimStatement,
    pid: str | None,
    lease: float | timedelta | None,
    after: tuple[Any, ...] | None = None,
) -> ClaimValues:
    """A new claim's pid (the caller's, checked, or this process's), fencing token,
    lease and where it starts. The lease is the caller's, else the statement's queue's
    ``LEASE``; a claim across queues gives each row its queue's (``lease_by_queue``)."""
    validate_pid(pid)
    by_queue: dict[str, timedelta] = {}
    if lease is None and statement.queue is None and statement.has_queues:
        by_queue = conf.lease_overrides()  # each row its queue's: a CASE in the claim
    duration = lease_of(statement.queue, lease)
    return ClaimValues(pid or consumer_identity(), secrets.randbits(63), duration, after, by_queue)


def lease_of(queue: str | None, given: float | timedelta | None = None) -> timedelta:
    """How long a claim of ``queue``'s items holds them: ``given`` (seconds or a timedelta,
    the caller's or ``run_queue_consumer --lease``), else the queue's ``LEASE`` (None: the
    top-level one). Claims and lease renewals both ask here."""
    if given is not None:
        return to_timedelta(given, "lease")
    return conf.lease(queue)


def retrying_conflicts(run: Callable[[], T], using: str, retries: int = TRANSIENT_RETRIES) -> T:
    """Run ``run``, a transaction of its own on ``using`` (one statement in autocommit, or
    an atomic block inside ``run``), again up to ``retries`` times with a short jittered
    pause while a conflict refuses it (``Dialect.is_transient``).

    Inside the caller's transaction it runs once: the conflict rolled the caller's whole
    transaction back (Galera aborts it all), so only the caller can run it again
    (``run_in_transaction``).
    """
    connection = connections[using]
    if connection.in_atomic_block:
        return run()
    vendor = dialect(connection)
    for attempt in range(retries):
        try:
            return run()
        except DatabaseError as exc:
            if not vendor.is_transient(exc) or connection.in_atomic_block:
                raise
            time.sleep(random.uniform(0.005, 0.02) * 2 ** min(attempt, 4))
    return run()


def update_retrying(rows: QuerySet[Any], **changes: Any) -> int:
    """``rows.update(**changes)``, a transaction of its own run again on a conflict
    (``retrying_conflicts``); how many rows changed."""
    return retrying_conflicts(lambda: int(rows.update(**changes)), rows.db)


def delete_retrying(rows: QuerySet[Any]) -> int:
    """``rows.delete()``, run again on a conflict as ``update_retrying``; how many went."""
    return retrying_conflicts(lambda: int(rows.delete()[0]), rows.db)


# -- settling a claim ----------------------------------------------------------------


def ack(item: QueueModel, result: Any = None) -> bool:
    """Mark the item DONE (with ``result`` where the model keeps one), if this claim
    still holds it."""
    if has_field(type(item), "result"):
        check_json(result, "result")
    # _holds_no_claim(item), written out: so the type checker knows the token is set.
    if item.claim_token is None or item.status != Status.IN_PROGRESS:
        return False
    if not ack_many(type(item), item._state.db or "default", item.claim_token, {item.pk: result}):
        return False
    mark_done(item, result)
    return True


def mark_done(item: QueueModel, result: Any = None) -> None:
    """Bring an acknowledged item's fields in line with its row: DONE, or CANCELLED if
    this instance knows of a cancellation request (one made after the last lease renewal
    read them settles the row CANCELLED too, but this instance still says DONE)."""
    requested = item.__dict__.get("cancel_requested_at") is not None  # no query if deferred
    item.status = Status.CANCELLED if requested else Status.DONE
    item.lease_expires_at = None
    if has_field(type(item), "result"):
        item.result = result  # type: ignore[attr-defined]
        item.__dict__.pop("finished_at", None)  # set by the database clock: load on access


def ack_many(model: type[Model], alias: str, claim_token: int, results: dict[Any, Any]) -> int:
    """Mark DONE, in one fenced UPDATE, items of one claim: ``{pk: result}``; those whose
    cancellation was requested meanwhile CANCELLED (``Dialect.ack_update``).

    Only rows still IN_PROGRESS under ``claim_token`` change; returns how many did.
    """
    if not results:
        return 0
    connection = connections[alias]
    sql, params = ack_statement(model, alias, claim_token, results)

    def run() -> int:
        with dialect(connection).hot_cursor(connection) as cursor:
            cursor.execute(sql, params)
            return int(cursor.rowcount)

    # InnoDB may pick an acknowledgement as a deadlock's victim (against an update_limit
    # claim, which locks as it reads), Galera refuse it against a claim of another node:
    # fenced, it is safe to run again.
    return retrying_conflicts(run, alias)


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
    vendor = dialect(connection)
    params += [*vendor.pk_params(list(results)), int(Status.IN_PROGRESS), claim_token]
    return vendor.ack_sql(model, connection, len(results), with_results), params


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
    vendor = dialect(statement.connection)
    resolved = vendor.resolve_strategy(strategy, statement.connection)
    if not (results and resolved == "skip_locked" and vendor.acks_while_claiming):
        acked = ack_many(statement.model, statement.alias, claim_token, results)
        return acked, claim(statement, pid=pid, strategy=resolved, lease=lease, after=after)
    values = claim_values(statement, pid, lease, after)
    ack = ack_statement(statement.model, statement.alias, claim_token, results)
    try:
        acked, items = retrying_conflicts(
            lambda: vendor.ack_and_claim(statement, values, ack), statement.alias
        )
    except DatabaseError as exc:
        if statement.connection.in_atomic_block or not vendor.is_transient(exc):
            raise
        # The claim kept losing races, and took the acknowledgement down with it.
        return ack_many(statement.model, statement.alias, claim_token, results), []
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
        "status": Case(
            When(requested, then=Value(int(Status.CANCELLED))),
            default=Value(int(status)),
            output_field=models.PositiveSmallIntegerField(),
        ),
    }


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
    asked = item.__dict__.get("cancel_requested_at") is not None
    item.status = Status.CANCELLED if asked else status
    if not asked and finished_at is None and has_field(type(item), "finished_at"):
        item.finished_at = None  # type: ignore[attr-defined]  # not finished, as it knows
    return True


def _change_if_held(item: QueueModel, **changes: Any) -> bool:
    """Apply ``changes`` only if the row is still IN_PROGRESS under this item's claim."""
    if _holds_no_claim(item):
        return False
    held = (
        type(item)
        ._base_manager.using(item._state.db or "default")
        .filter(pk=item.pk, status=Status.IN_PROGRESS, claim_token=item.claim_token)
    )
    changed = update_retrying(held, **changes)
    if changed:
        for name, value in changes.items():
            setattr(item, name, value)
        defer_computed(item)
    return bool(changed)


# -- cancelling ----------------------------------------------------------------------


def cancel(items: QuerySet[Any]) -> int:
    """Cancel ``items`` (QueueItem's) in one UPDATE: the READY ones end CANCELLED at once,
    finished now; the IN_PROGRESS ones not asked before get a cancellation request, which
    their handlers see with the next lease renewal (``cancel_requested()``) and which
    settles them CANCELLED. Finished items are left alone. Returns how many changed."""
    ready = Q(status=Status.READY)
    asked = Q(status=Status.IN_PROGRESS, cancel_requested_at__isnull=True)
    rows = items.order_by().filter(ready | asked)
    # status last: MySQL assigns left to right, and finished_at reads the status as it was.
    return update_retrying(
        rows,
        cancel_requested_at=Now(),
        finished_at=Case(
            When(ready, then=Now()),
            default=F("finished_at"),
            output_field=models.DateTimeField(),
        ),
        status=Case(
            When(ready, then=Value(int(Status.CANCELLED))),
            default=F("status"),
            output_field=models.PositiveSmallIntegerField(),
        ),
    )


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


# -- leases and rescue ---------------------------------------------------------------


def renew_leases(model: type[Model], alias: str, tokens: dict[Any, int], lease: timedelta) -> int:
    """Push the leases of in-flight items ``{pk: claim_token}`` to now + ``lease``."""
    if not tokens:
        return 0
    held = Q()
    for pk, token in tokens.items():
        held |= Q(pk=pk, claim_token=token)
    running = model._base_manager.using(alias).filter(held, status=Status.IN_PROGRESS)
    return update_retrying(running, lease_expires_at=Now() + lease)


def rescue(stuck: QuerySet[Any], *, fail: bool = False) -> int:
    """Stuck items go back to READY, or FAILED when their attempts are spent.

    ``fail=True`` fails them all at once, for work that must never run twice. A model
    without ``max_attempts`` (a plain QueueModel) always goes back to READY.
    """
    return retrying_conflicts(lambda: _rescue(stuck, fail), stuck.db)


def _rescue(stuck: QuerySet[Any], fail: bool) -> int:
    if not has_field(stuck.model, "max_attempts"):
        return stuck.update(**UNCLAIMED, status=Status.READY)
    failing = Q(pk__isnull=False) if fail else Q(attempts__gte=F("max_attempts"))
    reason = "stuck: lease expired or consumer died" + ("" if fail else ", attempts spent")
    endings = [When(failing, then=Value(Status.FAILED))]
    if has_field(stuck.model, "cancel_requested_at"):
        # Asked to stop: it is not run again, it ends CANCELLED (its error untouched).
        cancelled = Q(cancel_requested_at__isnull=False)
        failing &= ~cancelled
        endings = [
            When(cancelled, then=Value(Status.CANCELLED)),
            When(failing, then=Value(Status.FAILED)),
        ]
    ending = reduce(operator.or_, (when.condition for when in endings))
    return stuck.update(
        **UNCLAIMED,
        status=Case(*endings, default=Value(Status.READY)),
        finished_at=Case(
            When(ending, then=Now()), default=None, output_field=models.DateTimeField()
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
    # A stuck item's cancellation request goes: requeueing it is the later decision.
    changes = {
        **UNCLAIMED,
        "status": Status.READY,
        "run_at": Now(),
        "finished_at": None,
        "cancel_requested_at": None,
    }
    plain = allowed.exclude(status=Status.FAILED, dedup_key__isnull=False)
    changed = update_retrying(plain, **changes)
    holding_keys = allowed.filter(status=Status.FAILED, dedup_key__isnull=False)
    for pk in list(holding_keys.values_list("pk", flat=True)):
        one = holding_keys.filter(pk=pk)
        with suppress(IntegrityError):
            changed += retrying_conflicts(partial(_update_in_savepoint, one, changes), items.db)
    return changed


def _update_in_savepoint(rows: QuerySet[Any], changes: dict[str, Any]) -> int:
    with transaction.atomic(using=rows.db):
        return int(rows.update(**changes))


def fail_many(items: QuerySet[Any], *, stuck: Q, error: str) -> int:
    """Mark FAILED with ``error`` the READY ``items`` and those matching ``stuck``, checked in
    the UPDATE itself; a running item under a live consumer is left alone. For QueueItem."""
    failing = items.order_by().filter(Q(status=Status.READY) | stuck)
    return update_retrying(
        failing,
        **UNCLAIMED,
        status=Status.FAILED,
        finished_at=Now(),
        last_error=error,
        error_class="",
    )


def delete_finished(items: QuerySet[Any]) -> int:
    """Delete the DONE, FAILED and CANCELLED ``items``; returns how many."""
    return delete_retrying(items.order_by().filter(status__in=FINISHED))


def delete_all(items: QuerySet[Any]) -> int:
    """Delete ``items`` whatever their status, claimed ones included; returns how many.

    For a queue of a tool's own that it empties before and after a run (``txqueue_bench``,
    ``txqueue_chaos``): a consumer still holding one of these items would find it gone.
    """
    return delete_retrying(items.order_by())


def queues_with_due_items(model: type[Model], alias: str, names: list[str]) -> set[str]:
    """Which of the queues ``names`` on ``alias`` have a READY item due now, in one
    statement: what a consumer looks at before claiming from queues it knows nothing of."""
    return dialect_for(alias).queues_with_due_items(model, alias, names)


def release_lost(
    model: type[Model], alias: str, pid: str, held: Iterable[Any], claimed_before: timedelta
) -> int:
    """Put back READY, attempt not counted, the items ``pid`` claimed over
    ``claimed_before`` ago and does not hold: claims whose answer never reached it (the
    connection broke after the server committed). Without this they would wait out a
    whole lease under a consumer that is alive and renewing nothing for them."""
    lost = (
        model._base_manager.using(alias)
        .filter(status=Status.IN_PROGRESS, pid=pid, claimed_at__lt=Now() - claimed_before)
        .exclude(pk__in=list(held))
    )
    return update_retrying(
        lost, attempts=F("attempts") - 1, **UNCLAIMED, **unless_cancelled(model, Status.READY)
    )


def purge(items: QuerySet[Any], older_than: timedelta, *, until: float | None = None) -> int:
    """Delete DONE, FAILED and CANCELLED ``items`` finished over ``older_than`` ago, in
    small batches.

    Each batch is its own short statement, so a purge of millions of rows never holds
    locks for long. Returns how many were deleted.
    """
    finished = items.filter(status__in=FINISHED, finished_at__lt=Now() - older_than)
    return delete_in_batches(finished, "finished_at", until=until)


def purge_effects(
    effects: QuerySet[Any], older_than: timedelta, *, until: float | None = None
) -> int:
    """Delete ``once`` records made over ``older_than`` ago, in small batches."""
    old = effects.filter(recorded_at__lt=Now() - older_than)
    return delete_in_batches(old, "recorded_at", until=until)


def delete_in_batches(rows: QuerySet[Any], oldest: str, *, until: float | None = None) -> int:
    """Delete ``rows`` a batch of PURGE_BATCH at a time, the first in ``oldest`` order (an
    indexed column that ``rows`` bounds from above); how many were deleted.

    Each batch is read through that index: a purge reads the rows it deletes and no
    others. Walking the primary keys instead reads the whole table to find the few old
    rows (SQLite's plan: 110-180 ms and 105 MB read at 1,000,000 rows, at every consumer's
    start). No cursor is needed: a batch's rows are deleted, or have stopped matching, by
    the time the next is read.

    With ``until`` (a ``time.monotonic()`` instant) it stops after the batch that reaches
    it (always doing one, so that it makes progress), leaving the rest for later.
    """
    deleted = 0
    page = rows.order_by(oldest, "pk").values_list("pk", flat=True)
    while batch := list(page[:PURGE_BATCH]):
        deleted += delete_retrying(rows.filter(pk__in=batch))
        if until is not None and time.monotonic() >= until:
            break
    return deleted


def try_lock(alias: str, name: str) -> AbstractContextManager[bool]:
    """Hold the lock ``name`` of database ``alias`` if nobody does, without waiting;
    yields whether it is held (``Dialect.try_lock``)."""
    return dialect_for(alias).try_lock(connections[alias], name)


# -- pausing queues ------------------------------------------------------------------


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


# -- consumers -----------------------------------------------------------------------


def register(consumer: Consumer, using: str) -> Consumer:
    """Insert the Consumer row of a starting consumer."""
    retrying_conflicts(lambda: consumer.save(force_insert=True, using=using), using)
    return consumer


def beat(consumer: Consumer, *, processed: int, failed: int, queues: list[str]) -> None:
    """Heartbeat: the consumer is alive (database clock), with its counters and the queues
    it serves now (it may find new ones)."""
    update_retrying(
        _consumer_row(consumer),
        last_heartbeat_at=Now(),
        processed=processed,
        failed=failed,
        queues=queues,
    )


def stop(consumer: Consumer, *, processed: int, failed: int) -> None:
    """Mark the consumer stopped: its unfinished items are stuck from now on."""
    update_retrying(_consumer_row(consumer), stopped_at=Now(), processed=processed, failed=failed)


def delete_consumers(consumers: QuerySet[Any]) -> int:
    """Delete the rows of ``consumers``, stopped ones a tool ran for a while and that
    nobody needs to tell from live ones afterwards; returns how many."""
    return delete_retrying(consumers.order_by())


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
