"""New rows: items enqueued in the caller's transaction (bounded queues' count under their
bound row's lock, a dedup_key's unfinished twin), ``once()`` records, and the schedule's
tick rows with their items.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.db import IntegrityError, transaction
from django.db.models import Q

from ..db.inserts import Inserts, insert_or_ignore, inserts
from ..exceptions import QueueFull
from ..status import Status
from . import fairness, flows
from .bounds import lock_bound
from .conflicts import delete_retrying, retrying_conflicts

if TYPE_CHECKING:
    from django.db.models import Model

    from ..models import QueueItem

# Attempts at inserting a dedup_key item whose unfinished twin finishes meanwhile.
DEDUP_INSERT_ATTEMPTS = 3


def enqueue(
    model: type[QueueItem],
    using: str,
    values: dict[str, Any],
    payloads: Sequence[Any],
    *,
    fair: bool = False,
    bound: tuple[int, type[Model]] | None = None,
    varying: Sequence[str] | None = None,
    after: Sequence[Any] | None = None,
) -> list[QueueItem]:
    """Insert new items of one queue, one per payload, made of ``values`` (the fields but
    the payload), in the caller's transaction, all or none; the items.

    ``after``: the primary keys of the items they wait for (``flows.waiting_values``),
    locked and counted in the insert's transaction.

    ``fair``: each item joins its round (``fairness.first_round``). One item with a
    ``dedup_key`` gives way to its unfinished twin, which is returned in its place. With
    ``bound``, the queue's size limit and the model of its bound row, the queue's
    unfinished items are counted under that row's lock first, and ``QueueFull`` is
    raised having written nothing when the items do not fit. ``varying``: the only fields
    whose values differ between the items, if known (the INSERT converts the others
    once). Outside a caller's transaction the enqueue is a transaction of its own, run
    again when a conflict refuses it.
    """
    first_round = None
    if fair:
        first_round = fairness.first_round(model, values["queue"], values.get("key"), using)
    rows = inserts(model, using)
    unique = len(payloads) == 1 and values.get("dedup_key") is not None
    if bound is None and not unique and not after:
        # The usual enqueue: the INSERT alone.
        return retrying_conflicts(rows.add, using, values, payloads, first_round, varying)
    return retrying_conflicts(
        _enqueue_guarded, using, rows, values, payloads, first_round, bound, varying, after
    )


def _enqueue_guarded(
    rows: Inserts[QueueItem],
    values: dict[str, Any],
    payloads: Sequence[Any],
    first_round: int | None,
    bound: tuple[int, type[Model]] | None,
    varying: Sequence[str] | None,
    after: Sequence[Any] | None,
) -> list[QueueItem]:
    """An enqueue with more to it than its INSERT, in one transaction: the items waited
    for (``after``) locked and counted, a bounded queue's bound checked, one item's
    dedup_key twin looked for; the edges of a flow written last."""
    # savepoint=False: inside the caller's transaction it adds no query, and outside
    # one the lock, the count and the insert still share a transaction of their own. An
    # error is raised after the block, which would otherwise doom the caller's transaction.
    with transaction.atomic(using=rows.alias, savepoint=False):
        outcome = _checked_insert(rows, values, payloads, first_round, bound, varying, after)
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


def _checked_insert(
    rows: Inserts[QueueItem],
    values: dict[str, Any],
    payloads: Sequence[Any],
    first_round: int | None,
    bound: tuple[int, type[Model]] | None,
    varying: Sequence[str] | None,
    after: Sequence[Any] | None,
) -> list[QueueItem] | Exception:
    """``_enqueue_guarded``'s work in its transaction; the error it refuses with, if any."""
    if after:
        waiting = flows.waiting_values(rows.model, rows.alias, after, values)
        if isinstance(waiting, Exception):
            return waiting
        values = {**values, **waiting}
    items = _insert_checked(rows, values, payloads, first_round, bound, varying)
    if isinstance(items, Exception):
        return items
    new = [item for item in items if after and item.flow == values["flow"]]
    if new:  # not a twin given back in its place
        flows.add_edges(rows.model, rows.alias, new, after or ())
        flows.record_flow(rows.model, rows.alias, new)
    return items


def _insert_checked(
    rows: Inserts[QueueItem],
    values: dict[str, Any],
    payloads: Sequence[Any],
    first_round: int | None,
    bound: tuple[int, type[Model]] | None,
    varying: Sequence[str] | None,
) -> list[QueueItem] | QueueFull:
    """The INSERT, after a bounded queue's count (``QueueFull``, returned, when the items
    do not fit); one item with a dedup_key gives way to its unfinished twin."""
    using, queue, dedup_key = rows.alias, values["queue"], values.get("dedup_key")
    unique = len(payloads) == 1 and dedup_key is not None
    if bound is not None:
        max_size, bounds = bound
        current = lock_and_count(rows.model, queue, bounds, using)
        if current + len(payloads) > max_size:
            # A full queue still answers with the unfinished twin: it adds nothing.
            twin = unfinished_twin(rows.model, queue, dedup_key, using) if unique else None
            if twin is not None:
                return [twin]
            return QueueFull(rows.new(**values, payload=payloads[0]), current)
    if unique:
        return [insert_unique(rows, values, payloads[0], first_round)]
    return rows.add(values, payloads, first_round, varying)


# Rows alike but for their payload: their fields, and the indices of their payloads.
Run = tuple[dict[str, Any], list[int]]


def enqueue_flow(
    model: type[QueueItem],
    using: str,
    runs: list[Run],
    payloads: list[Any],
    waits: Mapping[int, Sequence[int]],
    *,
    bounds: dict[str, int],
    bound_model: type[Model],
    fair: set[str],
) -> list[QueueItem]:
    """Insert one flow's items, ``payloads`` with the fields of their ``runs``, and the
    edges from each that waits to those it waits for (``waits``: {its index into
    ``payloads``: theirs}), in the caller's transaction, all or none; the items, in the
    order of ``payloads``.

    Each run goes in one INSERT. ``bounds``: the bounded queues' sizes ({queue:
    MAX_SIZE}), checked under their bound rows' locks first (QueueFull); ``fair``: the
    fair queues, whose items get their rounds.
    """
    return retrying_conflicts(
        _enqueue_flow, using, model, using, runs, payloads, waits, bounds, bound_model, fair
    )


def _enqueue_flow(
    model: type[QueueItem],
    using: str,
    runs: list[Run],
    payloads: list[Any],
    waits: Mapping[int, Sequence[int]],
    bounds: dict[str, int],
    bound_model: type[Model],
    fair: set[str],
) -> list[QueueItem]:
    adding: Counter[str] = Counter()
    for values, indices in runs:
        adding[values["queue"]] += len(indices)
    # savepoint=False and the error raised after the block: as _enqueue_guarded.
    with transaction.atomic(using=using, savepoint=False):
        full = _first_full(model, using, adding, bounds, bound_model)
        if full is None:
            items = _insert_rows(model, using, runs, payloads, fair)
            flows.add_flow_edges(model, using, items, waits)
            flows.record_flow(model, using, items)
    if full is not None:
        queue, current = full
        values, indices = min(
            (run for run in runs if run[0]["queue"] == queue), key=lambda r: r[1][0]
        )
        first = inserts(model, using).new(**values, payload=payloads[indices[0]])
        raise QueueFull(first, current)
    return items


def _first_full(
    model: type[QueueItem],
    using: str,
    adding: Counter[str],
    bounds: dict[str, int],
    bound_model: type[Model],
) -> tuple[str, int] | None:
    """The first bounded queue the flow's items would overfill, and its unfinished count."""
    for queue in sorted(set(adding) & set(bounds)):
        current = lock_and_count(model, queue, bound_model, using)
        if current + adding[queue] > bounds[queue]:
            return queue, current
    return None


def _insert_rows(
    model: type[QueueItem], using: str, runs: list[Run], payloads: list[Any], fair: set[str]
) -> list[QueueItem]:
    """The items, one INSERT per run; in the order of ``payloads``, with their primary
    keys (read back where a multi-row INSERT gives none: MySQL)."""
    writer = inserts(model, using)
    items: list[Any] = [None] * len(payloads)
    for values, indices in runs:
        first_round = None
        if values["queue"] in fair:
            first_round = fairness.first_round(model, values["queue"], values.get("key"), using)
        varying = ["payload", "round"] if first_round is not None else ["payload"]
        made = writer.add(values, [payloads[n] for n in indices], first_round, varying)
        for n, item in zip(indices, made, strict=True):
            items[n] = item
    if any(item.pk is None for item in items):
        written = [items[n] for _, indices in runs for n in indices]
        flows.read_back_pks(model, using, written)
    return items


def unfinished_twin(
    model: type[QueueItem], queue: str, dedup_key: str | None, using: str
) -> QueueItem | None:
    """The unfinished item of ``queue`` that holds ``dedup_key``, if any."""
    if dedup_key is None:
        return None
    twins = model._default_manager.using(using)
    found: QueueItem | None = twins.filter(
        active_dedup_queue=queue, active_dedup_key=dedup_key
    ).first()
    return found


def lock_and_count(model: type[QueueItem], queue: str, bounds: type[Model], using: str) -> int:
    """Lock the bound row of ``queue``, then count the queue's unfinished items.

    The lock is held until the caller's transaction ends, so the count stays true until
    its insert commits: producers of this queue take turns, whatever the database. Only
    enqueues add unfinished items, and they all take this lock first; consumers
    finishing items only lower the count and need no lock. Lock order is always the
    bound row, then items (a claim of a ``MAX_IN_FLIGHT`` queue takes it too, first).
    """
    lock_bound(bounds, queue, using)
    # An OR of equalities, which PostgreSQL matches to the partial indexes (not so IN).
    # WAITING items count too: they are unfinished, and will run.
    unfinished = Q(status=Status.READY) | Q(status=Status.IN_PROGRESS) | Q(status=Status.WAITING)
    items = model._default_manager.using(using).filter(unfinished, queue=queue)
    return int(items.count())


def insert(item: QueueItem, using: str) -> QueueItem:
    inserts(type(item), using).insert([item])
    return item


def insert_unique(
    rows: Inserts[QueueItem], values: dict[str, Any], payload: Any, first_round: int | None
) -> QueueItem:
    """Insert the item of ``values`` and ``payload`` (in round ``first_round``, if any), or
    return the unfinished item of the same queue holding the same dedup_key.

    The unique index on (active_dedup_queue, active_dedup_key) decides races between
    producers; the savepoint keeps the caller's transaction usable after a conflict.
    """
    using, queue, dedup_key = rows.alias, values["queue"], values["dedup_key"]
    for _ in range(DEDUP_INSERT_ATTEMPTS):
        try:
            with transaction.atomic(using=using):
                return rows.add(values, [payload], first_round)[0]
        except IntegrityError:
            holder = unfinished_twin(rows.model, queue, dedup_key, using)
            if holder is not None:
                return holder
    raise IntegrityError(
        f"could not enqueue dedup_key {dedup_key!r} on queue {queue!r}: "
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
