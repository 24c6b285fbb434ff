"""Flows: items that wait for others (docs/flows.md).

An item enqueued ``after=`` others is WAITING, with ``waiting_for`` the number of those
not yet ended, and an edge (``QueueDependency``) to each. The end of an item waited for
is written in the same transaction that releases or cancels what waits for it (``ended``):
DONE counts one down, and the item waiting becomes READY at zero; FAILED or CANCELLED
cancels it (and, in turn, what waits for it), unless it ``runs_after_failure``, when it
counts one down as for DONE.

Plain items pay nothing for this. An item something waits for counts its
``dependent_count``, and the statements that end items in bulk (the acknowledgement, a failure, a
cancellation, a rescue) leave such rows alone: the rare rows they leave are ended here,
in a transaction of their own with what waits for them. A producer that attaches a new
item to one locks it first (``waiting_values``), so the two never miss each other.
"""

from __future__ import annotations

import uuid
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from django.apps import apps
from django.db import connections, transaction
from django.db.models import Case, Exists, F, OuterRef, Q, Value, When
from django.db.models.functions import Now

from ..db import dialect
from ..db.inserts import inserts
from ..status import FINISHED, UNFINISHED, Status, settled_as

if TYPE_CHECKING:
    from django.db.models import Model, QuerySet

    from ..models import QueueItem

# The ends of an item waited for that cancel what waits for it (unless it runs anyway).
FAILED_OR_CANCELLED = (Status.FAILED, Status.CANCELLED)
# Primary keys per statement: SQLite binds at most 32,766 parameters, older ones 999.
CHUNK = 500


def waiting_values(
    model: type[QueueItem], using: str, parents: Sequence[Any], values: dict[str, Any]
) -> dict[str, Any] | ValueError:
    """The fields of new items of ``values`` that wait for ``parents`` (primary keys on
    ``using``): the parents are locked, in the caller's transaction, then counted (their
    ``dependent_count`` is counted up by ``add_edges``). WAITING for those unfinished;
    READY if all are DONE; CANCELLED at once if one has failed or been cancelled and the
    items do not run after a failure (``values["runs_after_failure"]``). A ValueError,
    returned having written nothing, if one is not on ``using``."""
    rows = model._base_manager.using(using)
    found = dict(
        rows.select_for_update().filter(pk__in=parents).order_by("pk").values_list("pk", "status")
    )
    missing = [pk for pk in parents if pk not in found]
    if missing:
        return ValueError(
            f"after: no item {missing[0]!r} on database {using!r}; the items waited for "
            "must be on the same database as the new one"
        )
    flow = {"flow": uuid.uuid4()}
    failed = [(pk, status) for pk, status in found.items() if status in FAILED_OR_CANCELLED]
    if failed and not values.get("runs_after_failure"):
        pk, status = failed[0]
        return {**flow, **cancelled(pk, status)}
    unfinished = sum(1 for status in found.values() if status in UNFINISHED)
    return {
        **flow,
        "status": Status.WAITING if unfinished else Status.READY,
        "waiting_for": unfinished,
    }


def cancelled(parent: Any, status: int) -> dict[str, Any]:
    """The changes that cancel an item because ``parent`` ended in ``status``."""
    return {
        "status": Status.CANCELLED,
        "finished_at": Now(),
        "last_error": f"item {parent} it waited for ended {Status(status).label}",
    }


def edges_of(model: type[Model]) -> type[Model]:
    """The edges' model (``QueueDependency``), found through the app registry: the models
    import the store, not the reverse."""
    return apps.get_model(model._meta.app_label, "QueueDependency")


def flows_of(model: type[Model]) -> type[Model]:
    """Where the flows' items are (``QueueFlow``), found as ``edges_of`` finds the edges."""
    return apps.get_model(model._meta.app_label, "QueueFlow")


def record_flow(model: type[QueueItem], using: str, items: list[QueueItem]) -> None:
    """The row of the flow ``items`` were just inserted in (``QueueFlow``): the first
    and last of their primary keys, between which its items are read."""
    pks = [item.pk for item in items]
    flows = flows_of(model)
    # The enqueue's cached INSERT, as the edges': the ORM's save() took 0.26 ms, this 0.15.
    flow = flows._meta.pk.get_db_prep_save(items[0].flow, connections[using])
    inserts(flows, using).insert_columns(
        ["id", "first_item", "last_item"], [[flow], [min(pks)], [max(pks)]]
    )


def add_edges(
    model: type[QueueItem], using: str, items: list[QueueItem], parents: Sequence[Any]
) -> None:
    """The edges from each new item of one enqueue to each of ``parents`` (primary keys,
    locked by ``waiting_values``), and the parents' ``dependent_count`` counted up by them."""
    if any(item.pk is None for item in items):
        read_back_pks(model, using, items)
    children = [item.pk for item in items for _ in parents]
    insert_edges(model, using, children, list(parents) * len(items))
    more = F("dependent_count") + len(items)
    model._base_manager.using(using).filter(pk__in=parents).update(dependent_count=more)


def add_flow_edges(
    model: type[QueueItem], using: str, items: list[QueueItem], waits: Mapping[int, Sequence[int]]
) -> None:
    """The edges of a flow written at once: from each item that waits to each it waits
    for (``waits``: {its index into ``items``: theirs})."""
    children: list[Any] = []
    parents: list[Any] = []
    for waiter, waited in waits.items():
        children += [items[waiter].pk] * len(waited)
        parents += [items[n].pk for n in waited]
    insert_edges(model, using, children, parents)


def insert_edges(
    model: type[QueueItem], using: str, children: list[Any], parents: list[Any]
) -> None:
    """Insert the edges from each of ``children`` to the parent beside it in ``parents``
    (primary keys), a list per column, by the enqueue's own cached INSERT (``db.inserts``):
    ``bulk_create`` would build, compile and convert an instance per edge, and a list per
    edge made more work for the garbage collector than the rest of a big flow."""
    if children:
        inserts(edges_of(model), using).insert_columns(
            ["item_id", "parent_id"], [children, parents]
        )


def read_back_pks(model: type[QueueItem], using: str, items: list[QueueItem]) -> None:
    """Give the items of one flow, in the order they were inserted, their primary keys,
    which a multi-row INSERT did not return (MySQL): a table's auto-increment numbers one
    transaction's rows in the order it inserts them. Read from the newest row back:
    ``flow`` has no index, and past the flow's lie only rows inserted since."""
    rows = model._base_manager.using(using).filter(flow=items[0].flow).order_by("-pk")
    pks = list(rows.values_list("pk", flat=True)[: len(items)])
    for item, pk in zip(items, reversed(pks), strict=True):
        item.pk = pk


def ended(model: type[QueueItem], using: str, statuses: dict[Any, int]) -> None:
    """Release or cancel what waits for the items that ended as ``statuses`` says ({pk:
    status}), and in turn what waits for the items this cancels. In the caller's
    transaction: the one that ended them."""
    rows = model._base_manager.using(using)
    while statuses:
        counts, cancelling = waiting_on(model, using, statuses)
        count_down(rows, counts)
        statuses = cancel(rows, cancelling, statuses)


def waiting_on(
    model: type[QueueItem], using: str, statuses: dict[Any, int]
) -> tuple[Counter[Any], dict[Any, list[Any]]]:
    """The WAITING items that wait for the ended ones: how many of them each counts down,
    and, by the failed or cancelled item that cancels them, those that do not run after a
    failure."""
    edges = edges_of(model)._default_manager.using(using)
    counts: Counter[Any] = Counter()
    cancelled_by: dict[Any, Any] = {}
    for chunk in chunks(list(statuses)):
        found = edges.filter(parent_id__in=chunk, item__status=Status.WAITING).values_list(
            "item_id", "parent_id", "item__runs_after_failure"
        )
        for item, parent, runs in found:
            if statuses[parent] != Status.DONE and not runs:
                cancelled_by.setdefault(item, parent)
            else:
                counts[item] += 1
    cancelling: dict[Any, list[Any]] = defaultdict(list)
    for item, parent in cancelled_by.items():
        del counts[item]
        cancelling[parent].append(item)
    return counts, cancelling


def count_down(rows: QuerySet[Any], counts: Counter[Any]) -> None:
    """Count each WAITING item down by its count; READY at zero, and its queue's idle
    consumers told at commit (``Dialect.announce``: PostgreSQL's NOTIFY)."""
    by_count: dict[int, list[Any]] = defaultdict(list)
    for item, count in counts.items():
        by_count[count].append(item)
    released: set[str] = set()
    for count, items in by_count.items():
        for chunk in chunks(items):
            # status first: MySQL assigns left to right, and reads waiting_for here.
            changed = rows.filter(pk__in=chunk, status=Status.WAITING).update(
                status=Case(
                    When(waiting_for__lte=count, then=Value(int(Status.READY))),
                    default=Value(int(Status.WAITING)),
                ),
                waiting_for=F("waiting_for") - count,
            )
            if changed:
                ready = rows.filter(pk__in=chunk, status=Status.READY, waiting_for=0)
                released.update(ready.values_list("queue", flat=True).distinct())
    connection = connections[rows.db]
    for queue in sorted(released):
        dialect(connection).announce(connection, queue)


def cancel(
    rows: QuerySet[Any], cancelling: dict[Any, list[Any]], statuses: dict[Any, int]
) -> dict[Any, int]:
    """Cancel the WAITING items of ``cancelling`` for the item that ended badly; returns
    those cancelled that something waits for in turn, as ``ended`` takes them."""
    onward: dict[Any, int] = {}
    for parent, items in cancelling.items():
        for chunk in chunks(items):
            # Locked first: another transaction may end another item they wait for.
            waiting = dict(
                rows.select_for_update()
                .filter(pk__in=chunk, status=Status.WAITING)
                .order_by("pk")
                .values_list("pk", "dependent_count")
            )
            rows.filter(pk__in=list(waiting)).update(**cancelled(parent, statuses[parent]))
            onward |= {
                pk: int(Status.CANCELLED) for pk, waited_for in waiting.items() if waited_for
            }
    return onward


def end_waited_for(
    items: QuerySet[Any], changes: dict[str, Any], results: dict[Any, Any] | None = None
) -> int:
    """Change ``items``, which something waits for, with ``changes`` (and each its
    ``result`` of ``results``), in a transaction with what the ends of those it finishes
    release or cancel; how many changed."""
    model, using = items.model, items.db
    rows = model._base_manager.using(using)
    with transaction.atomic(using=using):
        pks = list(items.select_for_update().order_by("pk").values_list("pk", flat=True))
        if results is None:
            rows.filter(pk__in=pks).update(**changes)
        else:  # an acknowledgement's results, one each
            for pk in pks:
                rows.filter(pk=pk).update(**changes, result=results[pk])
        finished = rows.filter(pk__in=pks, status__in=FINISHED).values_list("pk", "status")
        ended(model, using, dict(finished))
    return len(pks)


# What an acknowledgement changes (``db.acks.AckStatement``'s UPDATE, as the ORM's),
# but the result.
ACKNOWLEDGED = {"status": settled_as(Status.DONE), "finished_at": Now(), "lease_expires_at": None}


def still_waited_for(model: type[Model], using: str, pks: list[Any]) -> set[Any]:
    """Which of the finished items ``pks`` a WAITING item waits for: a purge keeps them
    until it is released."""
    edges = edges_of(model)._default_manager.using(using)
    found: set[Any] = set()
    for chunk in chunks(pks):
        waiting = edges.filter(parent_id__in=chunk, item__status=Status.WAITING)
        found.update(waiting.values_list("parent_id", flat=True))
    return found


def forget(model: type[Model], using: str, deleted: dict[Any, uuid.UUID]) -> None:
    """After the flow items ``deleted`` ({pk: its flow}): delete their edges (to what they
    waited for, and from what waited for them), and the rows (``QueueFlow``) of the
    flows they left with no item."""
    edges = edges_of(model)._default_manager.using(using)
    for chunk in chunks(list(deleted)):
        edges.filter(Q(item_id__in=chunk) | Q(parent_id__in=chunk)).delete()
    rows = flows_of(model)._base_manager.using(using)
    left = model._base_manager.using(using).filter(
        flow=OuterRef("pk"), pk__gte=OuterRef("first_item"), pk__lte=OuterRef("last_item")
    )
    for chunk in chunks(list(set(deleted.values()))):
        rows.filter(pk__in=chunk).exclude(Exists(left)).delete()


def chunks(values: list[Any]) -> list[list[Any]]:
    return [values[start : start + CHUNK] for start in range(0, len(values), CHUNK)]
