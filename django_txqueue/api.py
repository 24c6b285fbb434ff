"""The queue API: ``enqueue``, ``enqueue_many`` and ``Queue``. Start reading here.

Everything validates its input before the first query, and joins the caller's
transaction: an enqueued item is invisible to consumers until the caller commits and
gone if it rolls back. Vendor SQL stays in ``claim/``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, connections, router, transaction
from django.db.models import Count, DurationField, ExpressionWrapper, Min
from django.db.models.functions import Now
from django.utils import timezone

from . import conf
from .claim import ClaimStatement, vendor_sql
from .exceptions import QueueFull
from .models import QueueItem, QueueItemQuerySet, Status, check_json, defer_computed, now_plus
from .wakeup import wake_local_consumers

MAX_QUEUE_NAME = 100
MAX_KEY_LENGTH = 255
INT_RANGE = (-(2**31), 2**31 - 1)
PURGE_BATCH = 1000
# Attempts at inserting a dedup_key item whose unfinished twin finishes meanwhile.
DEDUP_INSERT_ATTEMPTS = 3


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
) -> QueueItem:
    """Add one item to ``queue`` inside the caller's transaction and return it."""
    return Queue(queue, using=using).enqueue(
        payload,
        priority=priority,
        run_at=run_at,
        delay=delay,
        key=key,
        dedup_key=dedup_key,
        max_attempts=max_attempts,
    )


def enqueue_many(
    queue: str, payloads: Iterable[Any], *, using: str | None = None, **options: Any
) -> list[QueueItem]:
    """Add many items with the same options in one INSERT per batch, all or none."""
    return Queue(queue, using=using).enqueue_many(payloads, **options)


def validate_queue_name(name: Any) -> str:
    if not isinstance(name, str):
        raise TypeError(f"queue name must be a string, not {type(name).__name__}")
    if not 1 <= len(name) <= MAX_QUEUE_NAME:
        raise ValueError(
            f"queue name must be 1 to {MAX_QUEUE_NAME} characters, got {len(name)}: {name!r}"
        )
    return name


def validate_label(value: Any, what: str) -> str | None:
    """``key`` and ``dedup_key``: None, or a string of 1 to 255 characters."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a string, not {type(value).__name__}")
    if not 1 <= len(value) <= MAX_KEY_LENGTH:
        raise ValueError(f"{what} must be 1 to {MAX_KEY_LENGTH} characters, got {len(value)}")
    return value


def validate_int(value: Any, what: str, low: int, high: int = INT_RANGE[1]) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{what} must be between {low} and {high}, got {value}")
    return value


def validate_run_at(run_at: Any) -> datetime:
    if not isinstance(run_at, datetime):
        raise TypeError(f"run_at must be a datetime, not {type(run_at).__name__}")
    if settings.USE_TZ and timezone.is_naive(run_at):
        raise ValueError(
            f"run_at {run_at!r} is naive while USE_TZ is on; pass an aware datetime "
            "(e.g. django.utils.timezone.now() + timedelta(...))"
        )
    if not settings.USE_TZ and timezone.is_aware(run_at):
        return timezone.make_naive(run_at)
    return run_at


class Queue:
    """One named queue in one database: enqueue, claim, inspect and maintain it."""

    def __init__(self, name: str, using: str | None = None) -> None:
        self.name = validate_queue_name(name)
        self.using: str = (
            using or conf.queue_option(self.name, "DATABASE") or router.db_for_write(QueueItem)
        )
        self._claims: dict[int, ClaimStatement] = {}  # compiled once per batch size

    def __repr__(self) -> str:
        return f"Queue({self.name!r}, using={self.using!r})"

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
    ) -> QueueItem:
        """Add one item inside the caller's transaction and return it.

        With ``dedup_key``, while an unfinished item of this queue has the same key that
        item is returned and nothing is written.
        """
        item = self.build(
            payload,
            priority=priority,
            run_at=run_at,
            delay=delay,
            key=key,
            dedup_key=dedup_key,
            max_attempts=max_attempts,
        )
        self.check_room(item, adding=1)
        if dedup_key is None:
            item.save(force_insert=True, using=self.using)
        else:
            item = self.insert_unique(item)
        wake_local_consumers(self.name, self.using)
        defer_computed(item)
        return item

    def enqueue_many(self, payloads: Iterable[Any], **options: Any) -> list[QueueItem]:
        """Add many items with the same options, one INSERT per batch, all or none."""
        if options.get("dedup_key") is not None:
            raise ValueError("dedup_key names one item; enqueue such items one at a time")
        items = [self.build(payload, **options) for payload in payloads]
        if not items:
            return []
        self.check_room(items[0], adding=len(items))
        created = QueueItem.objects.using(self.using).bulk_create(items)
        wake_local_consumers(self.name, self.using)
        for item in created:
            defer_computed(item)
        return created

    def build(
        self,
        payload: Any,
        *,
        priority: int = 0,
        run_at: datetime | None = None,
        delay: float | timedelta | None = None,
        key: str | None = None,
        dedup_key: str | None = None,
        max_attempts: int | None = None,
    ) -> QueueItem:
        """A validated, unsaved item. Raises TypeError or ValueError; runs no query."""
        check_json(payload, f"payload for queue {self.name!r}")
        validate_int(priority, "priority", *INT_RANGE)
        if run_at is not None and delay is not None:
            raise ValueError("pass run_at or delay, not both")
        if max_attempts is None:
            max_attempts = conf.queue_option(self.name, "MAX_ATTEMPTS")
        item = QueueItem(
            queue=self.name,
            payload=payload,
            priority=priority,
            key=validate_label(key, "key"),
            dedup_key=validate_label(dedup_key, "dedup_key"),
            max_attempts=validate_int(max_attempts, "max_attempts", 1),
        )
        if run_at is not None:
            item.run_at = validate_run_at(run_at)
        elif delay is not None:
            # Due by the database clock, like every other time comparison.
            item.run_at = now_plus(conf.to_timedelta(delay, "delay"))
        return item

    def check_room(self, item: QueueItem, adding: int) -> None:
        """Raise QueueFull if ``adding`` items would take the queue past MAX_SIZE."""
        max_size = conf.queue_option(self.name, "MAX_SIZE")
        if max_size is None:
            return
        current = self.items.filter(status__in=[Status.READY, Status.IN_PROGRESS]).count()
        if current + adding > max_size:
            raise QueueFull(item, current)

    def insert_unique(self, item: QueueItem) -> QueueItem:
        """Insert, or return the unfinished item holding the same dedup_key.

        The unique index on (queue, active_dedup_key) decides races between producers;
        the savepoint keeps the caller's transaction usable after a conflict.
        """
        for _ in range(DEDUP_INSERT_ATTEMPTS):
            try:
                with transaction.atomic(using=self.using):
                    item.save(force_insert=True, using=self.using)
                return item
            except IntegrityError:
                holder = self.items.filter(active_dedup_key=item.dedup_key).first()
                if holder is not None:
                    return holder
        raise IntegrityError(
            f"could not enqueue dedup_key {item.dedup_key!r} on queue {self.name!r}: "
            "its unfinished twin kept changing"
        )

    # -- consuming -----------------------------------------------------------------

    def claim(
        self,
        limit: int = 1,
        *,
        pid: str | None = None,
        strategy: str = "auto",
        lease: float | timedelta | None = None,
    ) -> list[QueueItem]:
        """Claim up to ``limit`` due items (priority, run_at, id order) and return them."""
        if lease is None:
            lease = conf.queue_option(self.name, "LEASE")
        statement = self._claims.get(limit)
        if statement is None:
            statement = self._claims[limit] = ClaimStatement(self.items, limit)
        return statement.run(pid=pid, strategy=strategy, lease=lease)

    @contextmanager
    def dequeue(self) -> Iterator[QueueItem | None]:
        """Take one item inside a transaction (a savepoint when nested).

        Leaving the block normally marks the item DONE in that transaction; an
        exception rolls it back, and the item is READY for others at once. Yields None
        when nothing is ready.
        """
        connection = connections[self.using]
        # Row locks for the whole block where the database has them; SQLite has one
        # writer at a time, so its claim holds the database until the block ends.
        skip_locked = connection.features.has_select_for_update_skip_locked
        strategy = "skip_locked" if skip_locked else "update_limit"
        with transaction.atomic(using=self.using):
            claimed = self.claim(1, strategy=strategy)
            item = claimed[0] if claimed else None
            yield item
            if item is not None:
                item.ack()

    # -- inspecting ----------------------------------------------------------------

    def peek(self) -> QueueItem | None:
        """The item the next claim would take, unchanged (or None)."""
        return self.items.ready().order_by(*QueueItem.claim_order).first()

    def count(self, status: int | None = Status.READY) -> int:
        """Exact number of items in ``status`` (None: all)."""
        items = self.items if status is None else self.items.filter(status=status)
        return items.count()

    def approximate_count(self) -> int:
        """Cheap estimate of READY items from the planner's statistics; not transactional."""
        connection = connections[self.using]
        ready = self.items.filter(status=Status.READY)
        return int(vendor_sql(connection).approximate_count(ready))

    def stats(self) -> dict[str, Any]:
        """Counts per status, stuck items, and how long the oldest due item has waited."""
        by_status = {
            row["status"]: row["n"]
            for row in self.items.order_by().values("status").annotate(n=Count("pk"))
        }
        waited = self.items.ready().aggregate(
            age=ExpressionWrapper(Now() - Min("run_at"), output_field=DurationField())
        )["age"]
        return {
            "queue": self.name,
            "ready": by_status.get(Status.READY, 0),
            "in_progress": by_status.get(Status.IN_PROGRESS, 0),
            "done": by_status.get(Status.DONE, 0),
            "failed": by_status.get(Status.FAILED, 0),
            "stuck": self.items.stuck().count(),
            "oldest_ready_age_s": max(waited.total_seconds(), 0.0) if waited else 0.0,
        }

    # -- maintaining ---------------------------------------------------------------

    def requeue_stuck(self) -> int:
        """Rescue stuck items: READY again, or FAILED when their attempts are spent.

        A queue whose ``RESCUE`` setting is "fail" fails its stuck items at once.
        """
        return self.items.requeue_stuck(fail=conf.queue_option(self.name, "RESCUE") == "fail")

    def purge(self, older_than: float | timedelta = timedelta(0)) -> int:
        """Delete DONE and FAILED items finished over ``older_than`` ago, in small batches.

        Each batch is its own short statement, so a purge of millions of rows never
        holds locks for long. Returns how many were deleted.
        """
        cutoff = Now() - conf.to_timedelta(older_than, "older_than")
        finished = self.items.filter(
            status__in=[Status.DONE, Status.FAILED], finished_at__lt=cutoff
        )
        deleted, after = 0, 0
        while True:
            batch = list(
                finished.filter(pk__gt=after)
                .order_by("pk")
                .values_list("pk", flat=True)[:PURGE_BATCH]
            )
            if not batch:
                return deleted
            deleted += int(finished.filter(pk__in=batch).delete()[0])
            after = batch[-1]
