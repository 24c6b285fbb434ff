"""The queue API: ``enqueue``, ``enqueue_many`` and ``Queue``. Start reading here.

Everything validates its input before the first query, and joins the caller's
transaction: an enqueued item is invisible to consumers until the caller commits and
gone if it rolls back. Rows change only through ``store``; vendor SQL lives in ``db``.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from functools import cached_property
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from asgiref.sync import sync_to_async
from django.db import DEFAULT_DB_ALIAS, connections, router, transaction
from django.db.transaction import TransactionManagementError

from . import conf, store
from .consumer import registry
from .consumer.claims import Claims
from .consumer.wakeup import wake_local_consumers
from .db import dialect_for
from .db.inserts import inserts
from .models import QueueBound, QueueItem, QueueItemQuerySet, QueuePause, QueueProgress
from .observe import reads, tracing
from .status import Status
from .store import fairness
from .validation import (
    checked_queue_name,
    item_values,
    queue_name_problem,
    to_timedelta,
    validate_int,
    validate_queue_name,
)

if TYPE_CHECKING:
    from django.db.models import QuerySet

T = TypeVar("T")
P = ParamSpec("P")


def enqueue(
    queue: str,
    payload: Any,
    *,
    priority: int = 0,
    run_at: datetime | None = None,
    delay: float | timedelta | None = None,
    key: str | None = None,
    dedup_key: str | None = None,
    max_attempts: int | None = None,
    using: str | None = None,
    after: Iterable[QueueItem | int] | None = None,
    after_failure: str = "cancel",
) -> QueueItem:
    """Add one item to ``queue`` inside the caller's transaction and return it; with
    ``after``, WAITING until those items are done (docs/flows.md)."""
    return Queue(queue, using=using).enqueue(
        payload,
        priority=priority,
        run_at=run_at,
        delay=delay,
        key=key,
        dedup_key=dedup_key,
        max_attempts=max_attempts,
        after=after,
        after_failure=after_failure,
    )


def enqueue_many(
    queue: str, payloads: Iterable[Any], *, using: str | None = None, **options: Any
) -> list[QueueItem]:
    """Add many items with the same options in one INSERT per batch, all or none."""
    return Queue(queue, using=using).enqueue_many(payloads, **options)


def from_async(function: Callable[P, T], doc: str) -> Callable[P, Awaitable[T]]:
    """``function`` for async code: run in the thread Django gives synchronous database
    work (``sync_to_async``, thread-sensitive), as Django's async ORM methods run theirs."""

    @functools.wraps(function)
    async def run(*args: P.args, **kwargs: P.kwargs) -> T:
        return await sync_to_async(function, thread_sensitive=True)(*args, **kwargs)

    run.__name__ = run.__qualname__ = f"a{function.__name__}"
    run.__doc__ = doc
    return run


# Async code has no transaction.atomic: each of these commits its items on its own, at once
# (docs/producing.md says how to enqueue together with other writes from async code).
aenqueue = from_async(
    enqueue,
    """``enqueue`` for async code (an async view), with its arguments: the item commits on
    its own at once, unless the caller's sync code runs it inside ``transaction.atomic``.""",
)
aenqueue_many = from_async(
    enqueue_many,
    """``enqueue_many`` for async code, with its arguments: all the items or none, committed
    at once.""",
)


def home_database(queue: str) -> str:
    """Where ``queue``'s rows live: its ``DATABASE`` setting, else ``TXQUEUE["DATABASE"]``,
    else the router's answer for ``QueueItem`` (given the queue's name as the ``queue``
    hint)."""
    placed = conf.queue_options(queue)["DATABASE"]
    return str(placed or router.db_for_write(QueueItem, queue=queue))


def items_database(queue: str) -> str:
    """Where ``queue``'s items are found: where a source of its handler keeps it (a Django
    Tasks backend's ``DATABASE``), else its home (``home_database``)."""
    return registry.database(queue) or home_database(queue)


def configured_queues(alias: str) -> list[str]:
    """The queues ``TXQUEUE["QUEUES"]`` configures whose items are on ``alias``, sorted: the
    dashboard and ``txqueue_stats`` show them, with zeros, before their first item."""
    names = (name for name in conf.get("QUEUES") if queue_name_problem(name) is None)
    return sorted(name for name in names if items_database(name) == alias)


def default_database() -> str:
    """Where queues live unless placed: ``TXQUEUE["DATABASE"]``, else the router's answer
    for ``QueueItem``."""
    return str(conf.get("DATABASE") or router.db_for_write(QueueItem))


def queue_databases() -> list[str]:
    """Every alias the settings place queues on: the default, each queue's ``DATABASE``,
    and the Django Tasks backends' (registry sources)."""
    placed = (options.get("DATABASE") for options in conf.get("QUEUES").values())
    found = [default_database(), *filter(None, placed), *registry.databases()]
    return list(dict.fromkeys(found))


def refuse_other_transaction(using: str, what: str) -> None:
    """Refuse to write ``what`` on database ``using`` while this thread has a transaction
    open on another database only: the write would commit on its own, not with it."""
    if connections[using].in_atomic_block:
        return
    for connection in connections.all(initialized_only=True):
        if connection.in_atomic_block:
            raise TransactionManagementError(
                f"{what} lives on database {using!r}, but the transaction open here is on "
                f"{connection.alias!r}: it would not commit or roll back with that "
                f"transaction. Open the transaction on {using!r} (transaction.atomic(using="
                f"{using!r})), put the queue on {connection.alias!r} (its DATABASE setting), "
                f"or pass using={using!r} to write it on its own at once."
            )


def run_in_transaction(
    func: Callable[[], T], *, using: str | None = None, attempts: int = store.TRANSIENT_RETRIES + 1
) -> T:
    """Run ``func()`` in ``transaction.atomic(using=using)`` and return what it returns,
    running it again, ``attempts`` runs at most, while a conflict refuses the transaction:
    a deadlock, a Galera certification failure at COMMIT, a serialization failure. A
    refused transaction wrote nothing, so ``func`` must only be safe to run again: no
    effect outside the database before the commit (leave those to a queue's handler).

    Inside another atomic block it runs ``func`` once: a conflict rolls the outermost
    transaction back, and only its owner can run it again.
    """
    if not callable(func):
        raise TypeError(f"run_in_transaction needs a callable, got {func!r}")
    validate_int(attempts, "attempts", 1)
    alias = using or DEFAULT_DB_ALIAS

    def run() -> T:
        with transaction.atomic(using=alias):
            return func()

    return store.retrying_conflicts(run, alias, retries=attempts - 1)


class Queue:
    """One named queue in one database: enqueue, claim, inspect and maintain it.

    ``using`` places it; by default the queue's home (``home_database``). Enqueueing into a
    queue placed by default refuses to run outside a transaction the caller has open on
    another database; an explicit ``using`` says the caller knows.
    """

    def __init__(self, name: str, using: str | None = None) -> None:
        try:
            self.name = checked_queue_name(name)
        except TypeError:  # not a string; an unhashable one (a list) never reached the check
            self.name = validate_queue_name(name)
        self.chosen = using is not None
        self.using: str = using or home_database(self.name)

    def __repr__(self) -> str:
        return f"Queue({self.name!r}, using={self.using!r})"

    @cached_property
    def claims(self) -> Claims:
        """The claim path: statements compiled once per batch size, where claims resume
        (made on first use: an enqueue needs none of it)."""
        return Claims(self.name, self.items)

    @property
    def items(self) -> QueueItemQuerySet:
        """Every item of this queue, in any status."""
        return QueueItem.objects.using(self.using).filter(queue=self.name)

    # -- producing -----------------------------------------------------------------

    def enqueue(
        self,
        payload: Any,
        *,
        priority: int = 0,
        run_at: datetime | None = None,
        delay: float | timedelta | None = None,
        key: str | None = None,
        dedup_key: str | None = None,
        max_attempts: int | None = None,
        after: Iterable[QueueItem | int] | None = None,
        after_failure: str = "cancel",
    ) -> QueueItem:
        """Add one item inside the caller's transaction and return it.

        With ``dedup_key``, while an unfinished item of this queue has the same key that
        item is returned and nothing is written. With ``after``, the item is WAITING
        until those items (or ids) are DONE, and ends CANCELLED if one fails or is
        cancelled, unless ``after_failure="run"`` (docs/flows.md).
        """
        values = self.values(
            payload,
            priority=priority,
            run_at=run_at,
            delay=delay,
            key=key,
            dedup_key=dedup_key,
            max_attempts=max_attempts,
            after_failure=after_failure,
        )
        return self._add(values, [payload], varying=None, after=self.waited_for(after))[0]

    def enqueue_many(self, payloads: Iterable[Any], **options: Any) -> list[QueueItem]:
        """Add many items with the same options, one INSERT per batch, all or none."""
        if options.get("dedup_key") is not None:
            raise ValueError("dedup_key names one item; enqueue such items one at a time")
        payloads = list(payloads)
        after = self.waited_for(options.pop("after", None))
        values = self.values(payloads, **options)  # the payloads checked in one pass
        if not payloads:
            return []
        return self._add(values, payloads, varying=["payload"], after=after)

    def waited_for(self, after: Iterable[QueueItem | int] | None) -> list[Any] | None:
        """The primary keys of the items ``after`` names (items or ids), each once; the
        items must be saved, and on this queue's database."""
        if after is None:
            return None
        if isinstance(after, (QueueItem, int, str)):
            raise TypeError("after takes a list of items or ids, not one")
        pks: list[Any] = []
        for parent in after:
            if isinstance(parent, QueueItem):
                where = parent._state.db or DEFAULT_DB_ALIAS
                if parent.pk is None:
                    raise ValueError("after: an unsaved item; enqueue it first")
                if where != self.using:
                    raise ValueError(
                        f"after: item {parent.pk} is on database {where!r}, but queue "
                        f"{self.name!r} is on {self.using!r}: a flow lives on one database"
                    )
                pks.append(parent.pk)
            elif isinstance(parent, int) and not isinstance(parent, bool):
                pks.append(parent)
            else:
                raise TypeError(f"after takes items or their ids, not {type(parent).__name__}")
        return list(dict.fromkeys(pks)) or None

    def _add(
        self,
        values: dict[str, Any],
        payloads: list[Any],
        varying: list[str] | None,
        after: list[Any] | None = None,
    ) -> list[QueueItem]:
        """Store items of ``values``, one per payload (waiting for ``after``); wake idle
        consumers."""
        if not self.chosen:
            refuse_other_transaction(self.using, f"queue {self.name!r}")
        options = conf.queue_options(self.name)
        fair = bool(options["FAIR"])
        if fair and varying:
            varying = [*varying, "round"]
        max_size = options["MAX_SIZE"]
        bound = None if max_size is None else (max_size, QueueBound)
        added = store.enqueue(
            QueueItem,
            self.using,
            values,
            payloads,
            fair=fair,
            bound=bound,
            varying=varying,
            after=after,
        )
        wake_local_consumers(self.name, self.using)
        return added

    def build(self, payload: Any, **options: Any) -> QueueItem:
        """A validated, unsaved item. Raises TypeError or ValueError; runs no query."""
        values = self.values(payload, **options)
        item: QueueItem = inserts(QueueItem, self.using).new(**values, payload=payload)
        return item

    def values(
        self,
        payload: Any,
        *,
        priority: int = 0,
        run_at: datetime | None = None,
        delay: float | timedelta | None = None,
        key: str | None = None,
        dedup_key: str | None = None,
        max_attempts: int | None = None,
        after_failure: str = "cancel",
    ) -> dict[str, Any]:
        """Check ``payload`` (one item's, or a list of many's) and ``enqueue``'s options;
        returns the new items' fields but the payload. Raises TypeError or ValueError."""
        options = conf.queue_options(self.name)
        values = item_values(
            self.name,
            payload,
            priority=priority,
            run_at=run_at,
            delay=delay,
            key=key,
            dedup_key=dedup_key,
            max_attempts=options["MAX_ATTEMPTS"] if max_attempts is None else max_attempts,
            after_failure=after_failure,
        )
        if key is None and (setting := fairness.needs_key(self.name)):
            raise ValueError(f"queue {self.name!r} has {setting}: each item needs a key")
        if "delay" in values:
            # Due by the database clock, like every other time comparison.
            values["run_at"] = store.now_plus(values.pop("delay"))
        if (trace_context := tracing.current_context()) is not None:
            values["trace_context"] = trace_context  # else not written at all
        return values

    # -- consuming -----------------------------------------------------------------

    def claim(
        self,
        limit: int = 1,
        *,
        pid: str | None = None,
        strategy: str = "auto",
        lease: float | timedelta | None = None,
    ) -> list[QueueItem]:
        """Claim up to ``limit`` due items (round, priority, run_at, id order) and return them.

        ``lease`` defaults to this queue's ``LEASE``.
        """
        return self.claims.claim(limit, pid=pid, strategy=strategy, lease=lease)

    @contextmanager
    def dequeue(self) -> Iterator[QueueItem | None]:
        """Take one item inside a transaction (a savepoint when nested).

        Leaving the block normally marks the item DONE in that transaction; an
        exception rolls it back, and the item is READY for others at once. Yields None
        when nothing is ready.
        """
        # Inside the block's transaction every strategy holds its claim until the block
        # ends: row locks where the database has them, SQLite's one writer lock elsewhere.
        with transaction.atomic(using=self.using):
            claimed = self.claim(1)
            item = claimed[0] if claimed else None
            yield item
            if item is not None:
                item.ack()

    # -- pausing -------------------------------------------------------------------

    def pause(self) -> bool:
        """Stop claims of this queue, by every consumer, until ``resume()``: held in its
        database, so it holds across consumers and restarts. Items in flight finish, and
        ``enqueue`` goes on. False if it was paused already."""
        return store.pause(QueuePause.objects.using(self.using), self.name)

    def resume(self) -> bool:
        """Let claims take this queue's items again; waiting consumers hear of it at
        once. False if it was not paused."""
        resumed = store.resume(QueuePause.objects.using(self.using), self.name)
        if resumed:
            wake_local_consumers(self.name, self.using)
        return resumed

    def is_paused(self) -> bool:
        return QueuePause.objects.using(self.using).filter(queue=self.name).exists()

    # -- inspecting ----------------------------------------------------------------

    def peek(self) -> QueueItem | None:
        """The item the next claim would take, unchanged (or None)."""
        return self.claims.claimable.ready().order_by(*QueueItem.claim_order).first()

    def count(self, status: int | None = Status.READY) -> int:
        """Exact number of items in ``status`` (None: all)."""
        items = self.items if status is None else self.items.filter(status=status)
        return items.count()

    def approximate_count(self) -> int:
        """Cheap estimate of READY items from the planner's statistics; not transactional."""
        ready = self.items.filter(status=Status.READY)
        return dialect_for(self.using).approximate_count(ready)

    def stats(self) -> dict[str, Any]:
        """Counts per status, stuck items, and how long the oldest due item has waited;
        for a fair or ordered queue also ``keys_waiting`` and ``top_keys``.

        Never reads all the finished rows (``reads.queue_stats``).
        """
        return reads.queue_stats(self.name, self.items)

    # -- maintaining ---------------------------------------------------------------

    def requeue_stuck(self) -> int:
        """Rescue stuck items: READY again, or FAILED when their attempts are spent.

        A queue whose ``RESCUE`` setting is "fail" fails its stuck items at once.
        """
        return self.items.requeue_stuck(fail=conf.queue_option(self.name, "RESCUE") == "fail")

    def cancel(self, items: QuerySet[QueueItem] | None = None) -> int:
        """Cancel ``items`` (a queryset of QueueItem; only this queue's are touched), or,
        with None, every unfinished item of this queue, in one UPDATE: READY and WAITING
        ones end CANCELLED at once (and what a flow has waiting for them: docs/flows.md),
        IN_PROGRESS ones get a cancellation request their handlers see with the next
        lease renewal. Returns how many changed."""
        if items is None:
            return self.items.cancel()
        if items.model is not QueueItem:
            raise TypeError(f"Queue.cancel() takes a queryset of QueueItem, not {items.model}")
        return store.cancel(items.using(self.using).filter(queue=self.name))

    def purge(self, older_than: float | timedelta = timedelta(0)) -> int:
        """Delete DONE, FAILED and CANCELLED items finished over ``older_than`` ago, in
        small batches.

        Returns how many were deleted.
        """
        purged = store.purge(self.items, to_timedelta(older_than, "older_than"))
        if purged:
            store.forget_reports(QueueItem, QueueProgress, self.using)
        return purged


def requeue_all_stuck(using: str) -> int:
    """Rescue the stuck items of every queue on ``using``, each through its own
    ``Queue.requeue_stuck()`` so that per-queue ``RESCUE`` settings apply; returns how many.

    What ``txqueue_requeue_stuck`` does without queue names, and the admin's rescue button.
    """
    stuck = QueueItem.objects.using(using).stuck().order_by()
    names = sorted(set(stuck.values_list("queue", flat=True).distinct()))
    return sum(Queue(name, using=using).requeue_stuck() for name in names)
