"""The schema: Status, the abstract QueueModel, the QueueItem table and the Consumer registry.

Querysets read as intent (``ready()``, ``stuck()``); the state-changing methods are
thin and delegate to ``store``, the one module that writes queue rows.
"""

from __future__ import annotations

import math
import operator
import time
from collections.abc import Sequence
from datetime import timedelta
from functools import reduce
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from asgiref.sync import sync_to_async
from django.core.exceptions import ValidationError
from django.core.serializers.json import DjangoJSONEncoder
from django.core.validators import MinValueValidator
from django.db import models
from django.db.backends.ddl_references import Statement
from django.db.models import Case, F, Q, When
from django.db.models.functions import Now
from django.utils import timezone

from . import conf, store
from .db import dialect
from .db.compiler import ClaimStatement
from .exceptions import Snooze
from .status import UNFINISHED, Status
from .validation import MAX_LABEL, MAX_QUEUE_NAME, cron_problem, queue_name_problem

if TYPE_CHECKING:
    import uuid

    from django.db.backends.base.schema import BaseDatabaseSchemaEditor

__all__ = [
    "Consumer",
    "Dashboard",
    "Effect",
    "NotNullIndex",
    "PartialIndex",
    "PartialOnlyIndex",
    "PartialStatusIndex",
    "QueueBound",
    "QueueItem",
    "QueueModel",
    "QueuePause",
    "QueueProgress",
    "ScheduleTick",
    "Status",
    "StatusIndex",
    "any_status",
    "stuck_condition",
]

_M = TypeVar("_M", bound="QueueModel")


class PartialIndex(models.Index):
    """An index over the rows matching ``where()``, where the database has partial
    indexes (PostgreSQL, SQLite); elsewhere a plain index over ``plain_fields()``, or
    none when that is None."""

    def where(self) -> Q:
        raise NotImplementedError

    def plain_fields(self) -> list[str] | None:
        return list(self.fields)

    def create_sql(
        self,
        model: type[models.Model],
        schema_editor: BaseDatabaseSchemaEditor,
        using: str = "",
        **kwargs: Any,
    ) -> Statement:
        vendor = dialect(schema_editor.connection)
        if vendor.has_partial_indexes(schema_editor.connection):
            fields, condition = list(self.fields), self.where()
        elif (plain := self.plain_fields()) is not None:
            fields, condition = plain, None
        else:
            return Statement(vendor.no_op_sql)
        index = models.Index(fields=fields, name=self.name, condition=condition)
        return index.create_sql(model, schema_editor, using=using, **kwargs)

    def remove_sql(
        self, model: type[models.Model], schema_editor: BaseDatabaseSchemaEditor, **kwargs: Any
    ) -> str:
        vendor = dialect(schema_editor.connection)
        if (
            not vendor.has_partial_indexes(schema_editor.connection)
            and self.plain_fields() is None
        ):
            return vendor.no_op_sql
        return super().remove_sql(model, schema_editor, **kwargs)


class StatusIndex(PartialIndex):
    """An index over the rows in one status, in the order a claim reads them.

    Where the database has partial indexes (PostgreSQL, SQLite) it holds only the rows
    in ``status``, so finished rows never slow a claim down. MySQL and MariaDB have no
    partial indexes: there it is a composite index led by ``status``, which serves the
    same WHERE and ORDER BY as one range scan, so a locking claim examines (and locks)
    only the rows it returns.
    """

    def __init__(self, *, status: int, fields: list[str], name: str) -> None:
        super().__init__(fields=fields, name=name)
        self.status = int(status)

    def deconstruct(self) -> tuple[str, Sequence[Any], dict[str, Any]]:
        path, args, kwargs = super().deconstruct()
        kwargs["status"] = self.status
        return path, args, kwargs

    def where(self) -> Q:
        return Q(status=self.status)

    def plain_fields(self) -> list[str]:
        return ["status", *self.fields]


class PartialStatusIndex(StatusIndex):
    """A ``StatusIndex`` only where the database has partial indexes. Where it has none
    (MySQL, MariaDB) no index is made: another status-led index there, over every row,
    serves the same reads (the FAILED one, led by (status, queue)), and one more would
    cost every item's enqueue, claim and acknowledgement."""

    def plain_fields(self) -> None:  # type: ignore[override]
        return None


class NotNullIndex(PartialIndex):
    """An index over the rows where its first field is set: partial where the database
    has partial indexes, so the rows without one (most items have no key; unfinished
    items no ``finished_at``) cost nothing to write. A plain index on MySQL and MariaDB,
    where InnoDB only touches it when the field itself changes."""

    def where(self) -> Q:
        first = self.fields[0].lstrip("-")  # a descending field is named "-field"
        return Q(**{f"{first}__isnull": False})


class PartialOnlyIndex(PartialIndex):
    """An index over the items of fair queues (``round`` > 0), where the database has
    partial indexes. Where it has none (MySQL, MariaDB) no index is made: the READY
    ``StatusIndex`` there is led by status and serves the same reads, and a plain index
    would cost every item's enqueue and claim."""

    def where(self) -> Q:
        return Q(round__gt=0)

    def plain_fields(self) -> None:
        return None


class ConsumerQuerySet(models.QuerySet["Consumer"]):
    def dead(self) -> ConsumerQuerySet:
        """Consumers that stopped, or whose heartbeat is older than CONSUMER_TIMEOUT."""
        silent_since = Now() - timedelta(seconds=conf.get("CONSUMER_TIMEOUT"))
        return self.filter(Q(stopped_at__isnull=False) | Q(last_heartbeat_at__lt=silent_since))

    def alive(self) -> ConsumerQuerySet:
        return self.exclude(pk__in=self.dead().values("pk"))


class Consumer(models.Model):
    """One row per running consumer process; lets anyone tell live consumers from dead."""

    id = models.BigAutoField(primary_key=True)
    identity = models.CharField(
        max_length=255, unique=True, help_text="The pid it writes on items."
    )
    host = models.CharField(max_length=255)
    os_pid = models.PositiveIntegerField()
    queues = models.JSONField(default=list, blank=True)
    wakeup_address = models.CharField(max_length=100, blank=True, default="")
    started_at = models.DateTimeField(db_default=Now())
    last_heartbeat_at = models.DateTimeField(db_default=Now())
    stopped_at = models.DateTimeField(null=True, blank=True)
    processed = models.PositiveBigIntegerField(default=0)
    failed = models.PositiveBigIntegerField(default=0)

    objects = ConsumerQuerySet.as_manager()

    class Meta:
        verbose_name = "consumer"

    def __str__(self) -> str:
        return self.identity


def any_status(*statuses: int) -> Q:
    """Items in one of ``statuses``, written as an OR of equalities rather than ``IN``:
    PostgreSQL then matches each to its partial index (a BitmapOr), where it scans the
    table for an IN list."""
    return reduce(operator.or_, (Q(status=status) for status in statuses))


def stuck_condition() -> Q:
    """The WHERE of ``stuck()``, for an UPDATE that must act on stuck items in one statement."""
    dead = Consumer.objects.dead().values("identity")
    return Q(status=Status.IN_PROGRESS) & (Q(lease_expires_at__lt=Now()) | Q(pid__in=dead))


class Effect(models.Model):
    """The record that an external effect happened: ``idempotency.once`` writes it in the
    transaction of the effect's bookkeeping; the unique key lets only one commit."""

    id = models.BigAutoField(primary_key=True)
    key = models.CharField(max_length=MAX_LABEL, unique=True)
    recorded_at = models.DateTimeField(db_default=Now(), db_index=True)

    class Meta:
        verbose_name = "effect"

    def __str__(self) -> str:
        return self.key


class QueueBound(models.Model):
    """One row per bounded queue (``MAX_SIZE``), created by its first enqueue.

    A producer locks its queue's row before counting and holds it until its transaction
    ends, so producers of one bounded queue count and insert one at a time and the bound
    is exact; unbounded queues never touch this table.
    """

    queue = models.CharField(max_length=MAX_QUEUE_NAME, primary_key=True)
    # Written by every locking upsert: an upsert needs a column to update, and this one
    # tells when the queue last took an item.
    locked_at = models.DateTimeField()

    class Meta:
        verbose_name = "queue bound"

    def __str__(self) -> str:
        return self.queue


class QueueRate(models.Model):
    """The claims counted against one rate limit (docs/limits.md): a queue's own
    (``RATE_LIMIT``, ``key`` empty) or one key's (``RATE_LIMIT_PER_KEY``), created by the
    first claim under it.

    A claim of a rate-limited queue locks the row, counts the items claimed in the last
    period, claims no more than the budget left and records its own, in one transaction:
    claims under one limit take turns, and the budget is exact across every consumer.
    """

    id = models.BigAutoField(primary_key=True)
    queue = models.CharField(max_length=MAX_QUEUE_NAME)
    per_key = models.BooleanField(default=False)
    key = models.CharField(max_length=MAX_LABEL, blank=True, default="")
    # [[microseconds since the epoch by the database clock, items], ...], oldest first:
    # the claims of the last period but the newest, which ``last_at`` holds.
    claims = models.JSONField(default=list)
    # The newest claim, timed by the database in the statement that records it, after
    # the claim's own: never earlier than the items' ``claimed_at``.
    last_at = models.DateTimeField(null=True)
    last_items = models.PositiveIntegerField(default=0)
    # While no budget is left: when the oldest claim counted leaves the period. A claim
    # of a per-key limited queue passes over the keys whose row says so.
    full_until = models.DateTimeField(null=True)

    class Meta:
        verbose_name = "queue rate"
        constraints = [
            models.UniqueConstraint(fields=["queue", "per_key", "key"], name="txqueue_rate_unique")
        ]

    def __str__(self) -> str:
        return f"{self.queue} [{self.key}]" if self.per_key else self.queue


class QueueQuerySet(models.QuerySet[_M]):
    """Claims and the states of a queue table, for any QueueModel."""

    def ready(self) -> QueueQuerySet[_M]:
        """Items a claim may take now."""
        return self.filter(status=Status.READY)

    def in_progress(self) -> QueueQuerySet[_M]:
        return self.filter(status=Status.IN_PROGRESS)

    def stuck(self) -> QueueQuerySet[_M]:
        """IN_PROGRESS items whose lease expired or whose consumer is dead (database clock).

        An item claimed by a pid with no Consumer row is stuck only once its lease expires.
        """
        return self.filter(stuck_condition())

    def claim(
        self,
        limit: int = 1,
        *,
        pid: str | None = None,
        strategy: str = "auto",
        lease: float | timedelta | None = None,
    ) -> list[_M]:
        """Move up to ``limit`` ready items to IN_PROGRESS under a new claim and return them.

        Respects this queryset's filters and ``order_by`` (default: the model's
        ``claim_order``). ``lease`` defaults to each item's queue's ``LEASE``.
        ``skip_locked`` skips rows other transactions hold; ``update_limit`` may wait
        for them; ``auto`` takes the best this database has.
        """
        return store.claim(ClaimStatement(self, limit), pid=pid, strategy=strategy, lease=lease)

    def requeue_stuck(self) -> int:
        """Put stuck items back to READY; returns how many."""
        return store.rescue(self.stuck())


class QueueModel(models.Model):
    """Abstract base that makes any table a queue: STATUS and PID columns, claimed in place.

    Subclasses get ``objects.claim(...)``, ``ready()``, ``stuck()`` and the fenced
    ``ack()``, ``release()`` and ``fail()``. Claims read the ``claim_order`` (pk, FIFO)
    unless the queryset has its own ``order_by``.
    """

    claim_order: ClassVar[tuple[str, ...]] = ("pk",)

    status = models.PositiveSmallIntegerField(choices=Status.choices, default=Status.READY)
    pid = models.CharField(max_length=255, blank=True, default="")
    # A fresh random token per claim: the fence for every acknowledgement.
    claim_token = models.BigIntegerField(null=True, blank=True, editable=False)
    attempts = models.PositiveIntegerField(default=0)
    claimed_at = models.DateTimeField(null=True, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)

    objects = QueueQuerySet.as_manager()

    class Meta:
        abstract = True
        indexes = [
            StatusIndex(status=Status.READY, fields=["id"], name="%(app_label)s_%(class)s_rdy"),
            StatusIndex(
                status=Status.IN_PROGRESS,
                fields=["claim_token"],
                name="%(app_label)s_%(class)s_clm",
            ),
        ]

    def ack(self) -> bool:
        """Mark the item DONE if this claim still holds it."""
        return store.ack(self)

    def release(self) -> bool:
        """Put the item back READY without counting the attempt."""
        return store.release(self)

    def fail(self, error: str | None = None) -> bool:
        """Mark the item FAILED. QueueModel has no column for ``error``; QueueItem keeps it."""
        return store.fail(self, error)


# ``report_progress`` writes at most once per this many seconds, however often called.
PROGRESS_EVERY = 1.0
# A progress message longer than this is cut: it is a status line, not a log.
PROGRESS_MESSAGE_LENGTH = 500


def progress_report(done: Any, total: Any, message: Any) -> dict[str, Any]:
    """``report_progress``'s arguments as its report, or a clear error naming the bad one."""
    for name, value in (("done", done), ("total", total)):
        if value is None and name == "total":
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (number and math.isfinite(value) and value >= 0):
            raise ValueError(f"report_progress: {name} must be a number >= 0, not {value!r}")
    if not isinstance(message, str):
        raise TypeError(f"report_progress: message must be a str, not {type(message).__name__}")
    return {"done": done, "total": total, "message": message[:PROGRESS_MESSAGE_LENGTH]}


class QueueItemQuerySet(QueueQuerySet["QueueItem"]):
    def ready(self) -> QueueItemQuerySet:
        """READY items whose ``run_at`` has come (database clock)."""
        return self.filter(status=Status.READY, run_at__lte=Now())

    def ready_queue_names(self) -> list[str]:
        """The names of the queues that have READY items, read from the index."""
        names = self.filter(status=Status.READY).order_by("queue").values_list("queue", flat=True)
        return list(names.distinct())

    def requeue_stuck(self, *, fail: bool = False) -> int:
        """Stuck items go back to READY, or FAILED when their attempts are spent.

        ``fail=True`` fails them all at once, for work that must never run twice.
        """
        return store.rescue(self.stuck(), fail=fail)

    def requeue(self) -> int:
        """READY and due now, attempts kept: the FAILED and READY items among these, and the
        stuck ones; never a running item whose consumer is alive, nor a DONE one."""
        return store.requeue(self, stuck=stuck_condition())

    def mark_failed(self, error: str) -> int:
        """FAILED with ``error``: the READY items among these and the stuck ones."""
        return store.fail_many(self, stuck=stuck_condition(), error=error)

    def delete_finished(self) -> int:
        """Delete the DONE, FAILED and CANCELLED items among these; returns how many."""
        deleted = store.delete_finished(self)
        if deleted:
            store.forget_reports(QueueItem, QueueProgress, self.db)
        return deleted

    def cancel(self) -> int:
        """Cancel these items in one UPDATE: READY and WAITING ones end CANCELLED at once,
        IN_PROGRESS ones get a cancellation request (``QueueItem.cancel``); returns how
        many changed."""
        return store.cancel(self)

    def in_flow(self, flow: uuid.UUID) -> QueueItemQuerySet:
        """The items among these of flow ``flow``, read along the primary key between the
        first and last its enqueue wrote (``QueueFlow``): ``flow`` has no index. Where
        its row is missing (deleted by hand), every row is read."""
        span = QueueFlow.objects.using(self.db).filter(pk=flow)
        bounds = span.values_list("first_item", "last_item").first()
        items = self.filter(flow=flow)
        return items.filter(pk__range=bounds) if bounds is not None else items

    def cancel_requests(self, held: dict[Any, int]) -> dict[Any, Any]:
        """``{pk: cancel_requested_at}`` of the items ``held`` (``{pk: claim_token}``) that
        are still IN_PROGRESS under that claim and were asked to stop: one read through
        the IN_PROGRESS claim-token index."""
        if not held:
            return {}
        asked = self.filter(
            status=Status.IN_PROGRESS,
            claim_token__in=set(held.values()),
            cancel_requested_at__isnull=False,
        ).values_list("pk", "claim_token", "cancel_requested_at")
        return {pk: at for pk, token, at in asked if held.get(pk) == token}


class QueueItem(QueueModel):
    """The app's own generic queue table: one row per unit of work."""

    # A fair queue's rounds come first; every other queue's items are all in round 0.
    claim_order: ClassVar[tuple[str, ...]] = ("round", "priority", "run_at", "pk")

    id = models.BigAutoField(primary_key=True)
    queue = models.CharField(max_length=MAX_QUEUE_NAME)
    payload = models.JSONField(encoder=DjangoJSONEncoder, null=True, blank=True)
    priority = models.IntegerField(default=0, help_text="Lower runs first.")
    run_at = models.DateTimeField(db_default=Now(), help_text="Not before.")
    # NULL, not "", means "none": the unique index below ignores NULLs.
    key = models.CharField(max_length=255, null=True, blank=True)  # noqa: DJ001
    # A fair queue's round (``fairness``): claims serve round 1 before round 2, and so on.
    # 0 in every other queue. Big: a busy key starts a new round with each item.
    round = models.BigIntegerField(default=0, db_default=0, editable=False)
    dedup_key = models.CharField(max_length=255, null=True, blank=True)  # noqa: DJ001
    # dedup_key while the item is unfinished, else NULL: a plain unique index on it
    # holds "one unfinished item per dedup_key" on every vendor, MySQL included.
    active_dedup_key = models.GeneratedField(
        expression=Case(
            When(status__in=UNFINISHED, then=F("dedup_key")),
            default=None,
        ),
        output_field=models.CharField(max_length=255, null=True),
        db_persist=True,
    )
    # The queue of an unfinished item with a dedup_key, else NULL: the unique index is on
    # (active_dedup_queue, active_dedup_key), all NULL for every other row. Galera
    # certifies each write against the unique keys of the rows it writes, NULL parts
    # included: on (queue, active_dedup_key), ("sms", NULL) made every write of a queue's
    # rows conflict with every other node's concurrent one (docs/scaling.md).
    active_dedup_queue = models.GeneratedField(
        expression=Case(
            When(
                status__in=UNFINISHED,
                dedup_key__isnull=False,
                then=F("queue"),
            ),
            default=None,
        ),
        output_field=models.CharField(max_length=MAX_QUEUE_NAME, null=True),
        db_persist=True,
    )
    max_attempts = models.PositiveIntegerField(default=5)
    last_error = models.TextField(blank=True, default="")
    # The dotted path of the exception class behind last_error ("" when there was none:
    # a failure by hand, or by a rescue).
    error_class = models.CharField(max_length=255, blank=True, default="")
    result = models.JSONField(encoder=DjangoJSONEncoder, null=True, blank=True)
    created_at = models.DateTimeField(db_default=Now())
    finished_at = models.DateTimeField(null=True, blank=True)
    # When someone asked a running item to stop (``cancel()``); its handler polls it
    # through ``cancel_requested()``, and returning after it settles the item CANCELLED.
    cancel_requested_at = models.DateTimeField(null=True, blank=True, editable=False)
    # The enqueuer's W3C trace context (``{"traceparent": ..., "tracestate": ...}``, as
    # OpenTelemetry's propagators write it), for the consumer's span to link to; NULL, and
    # left out of the INSERT, when there was no active span (``tracing``).
    trace_context = models.JSONField(null=True, blank=True, editable=False)
    # Flows (docs/flows.md). A WAITING item waits for ``waiting_for`` more items to end;
    # one of them failed or cancelled cancels it, unless it ``runs_after_failure``.
    waiting_for = models.PositiveIntegerField(default=0, db_default=0, editable=False)
    runs_after_failure = models.BooleanField(default=False, db_default=False, editable=False)
    # How many items were enqueued to wait for this one (its edges from them): its end
    # releases or cancels them (``store.flows``); 0 for an item outside any flow, whose
    # acknowledgement is plain. Only grows: a producer that adds one changes it, so an
    # acknowledgement that finds it as its claim read it knows every edge to the row.
    dependent_count = models.PositiveIntegerField(default=0, db_default=0, editable=False)
    # The items enqueued together with ``after=`` share one (their ``QueueFlow``).
    flow = models.UUIDField(null=True, blank=True, editable=False)
    # How often its handler snoozed it (``Snooze``) without using an attempt; past the
    # queue's MAX_SNOOZES a snooze uses one.
    snoozes = models.PositiveIntegerField(default=0, db_default=0, editable=False)

    objects = QueueItemQuerySet.as_manager()  # type: ignore[misc]

    class Meta:
        verbose_name = "queue item"
        indexes = [
            StatusIndex(
                status=Status.READY,
                fields=["queue", "round", "priority", "run_at", "id"],
                name="txqueue_item_ready",
            ),
            StatusIndex(
                status=Status.IN_PROGRESS, fields=["claim_token"], name="txqueue_item_claimed"
            ),
            # For the admin at a million rows: the exact search by key and by
            # dedup key, the throughput chart and purge (by finished_at), and the FAILED
            # filter and per-queue counts. DONE needs none: the newest DONE rows are the
            # newest rows, read backwards along the primary key.
            # Also a key's unfinished items in enqueue order, for fair and ordered queues.
            NotNullIndex(fields=["key", "queue", "status", "id"], name="txqueue_item_key"),
            # The last round a fair queue served (``fairness.served_round``). MySQL reads
            # it from the READY index, which is led by status there.
            PartialOnlyIndex(fields=["queue", "status", "round"], name="txqueue_item_served"),
            NotNullIndex(fields=["dedup_key"], name="txqueue_item_dedup_key"),
            NotNullIndex(fields=["finished_at"], name="txqueue_item_finished"),
            StatusIndex(status=Status.FAILED, fields=["queue"], name="txqueue_item_failed"),
            # The CANCELLED filter and per-queue counts, as for FAILED.
            PartialStatusIndex(
                status=Status.CANCELLED, fields=["queue"], name="txqueue_item_cancelled"
            ),
            # The WAITING filter and per-queue counts, as for CANCELLED.
            PartialStatusIndex(
                status=Status.WAITING, fields=["queue"], name="txqueue_item_waiting"
            ),
            # None on ``flow``: a flow's items are found along the primary key (QueueFlow).
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["active_dedup_queue", "active_dedup_key"],
                name="txqueue_item_unique_dedup",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.queue} #{self.pk}"

    def dependencies(self) -> QueueItemQuerySet:
        """The items this one waits (or waited) for: a handler reads their ``result``."""
        edges = QueueDependency.objects.using(self._state.db).filter(item_id=self.pk)
        return QueueItem.objects.using(self._state.db).filter(pk__in=edges.values("parent_id"))

    def dependents(self) -> QueueItemQuerySet:
        """The items that wait (or waited) for this one."""
        edges = QueueDependency.objects.using(self._state.db).filter(parent_id=self.pk)
        return QueueItem.objects.using(self._state.db).filter(pk__in=edges.values("item_id"))

    def ack(self, result: Any = None) -> bool:
        """Mark the item DONE with ``result`` (JSON) if this claim still holds it."""
        return store.ack(self, result)

    def fail(self, error: str | None = None) -> bool:
        """Mark the item FAILED, keeping ``error``, if this claim still holds it."""
        return store.fail(self, error)

    def retry(self, error: str | None = None, delay: float | timedelta | None = None) -> bool:
        """Put the item back READY after ``delay`` (default: back-off with jitter).

        Once ``max_attempts`` claims have been spent it ends FAILED with ``error`` instead.
        """
        return store.retry(self, error, delay)

    def snooze(self, seconds: float) -> bool:
        """Put the item back READY to run in ``seconds``, without using an attempt, if this
        claim still holds it (past its queue's ``MAX_SNOOZES``, as a retry that uses one).
        A handler may ``raise Snooze(seconds)`` instead, which the consumer settles."""
        return store.snooze(self, Snooze(seconds).seconds)

    def cancel(self) -> bool:
        """Cancel this item: READY, it ends CANCELLED at once; IN_PROGRESS, it gets a
        cancellation request that its handler can poll (``cancel_requested()``), and
        settles CANCELLED when the handler returns or raises. Returns whether it changed:
        False for a finished item, or one whose cancellation was requested already."""
        return store.cancel_item(self)

    def time_left(self) -> float | None:
        """Seconds its handler has left before its queue's ``TIMEOUT`` stops it (0 once
        past it), or None without one: for a handler to stop cleanly before the hard
        limit (docs/limits.md). Counted from the handler's start in a consumer; for an
        item claimed by hand, from its ``claimed_at`` by this host's clock."""
        timeout = conf.queue_option(self.queue, "TIMEOUT")
        if timeout is None:
            return None
        deadline: float | None = self.__dict__.get("_handler_deadline")  # timeouts.DEADLINE
        if deadline is not None:
            return max(deadline - time.monotonic(), 0.0)
        if self.claimed_at is None:
            return float(timeout)
        ran = (timezone.now() - self.claimed_at).total_seconds()
        return max(float(timeout) - ran, 0.0)

    def report_progress(self, done: float, total: float | None = None, message: str = "") -> bool:
        """Record how far this item's handler has come, read back as ``progress`` here at
        once, and by anyone (the admin, the dashboard, another process) once written.

        Cheap to call every few rows: it writes at most once a second (``PROGRESS_EVERY``),
        the latest report then, and the consumer writes a report still held back when the
        handler returns. Fenced like an acknowledgement: False, and nothing written, once
        this claim no longer holds the item; True otherwise (also when held back)."""
        return self._hold_progress(done, total, message) or self.write_progress()

    async def areport_progress(
        self, done: float, total: float | None = None, message: str = ""
    ) -> bool:
        """``report_progress`` for an ``async def`` handler: a write that is due runs where
        Django's async ORM runs its queries, not on the event loop."""
        if self._hold_progress(done, total, message):
            return True
        return await sync_to_async(self.write_progress, thread_sensitive=True)()

    def _hold_progress(self, done: float, total: float | None, message: str) -> bool:
        """Take the report; whether its write waits (one was written within a second)."""
        self.__dict__["_progress"] = progress_report(done, total, message)
        if (
            time.monotonic() - self.__dict__.get("_progress_written", -PROGRESS_EVERY)
            < PROGRESS_EVERY
        ):
            self.__dict__["_progress_held"] = True
            return True
        return False

    def write_progress(self, now: float | None = None) -> bool:
        """Write the report ``report_progress`` holds (the consumer calls this for one held
        back when the handler returns); False if this claim no longer holds the item, or
        there is no report to write."""
        if "_progress" not in self.__dict__:
            return False
        self.__dict__.pop("_progress_held", None)
        self.__dict__["_progress_written"] = time.monotonic() if now is None else now
        return store.report_progress(self, QueueProgress, self.__dict__["_progress"])

    @property
    def progress(self) -> dict[str, Any] | None:
        """The last progress report of the item's latest run, ``{"done", "total",
        "message"}``, or None before any. One query, unless this instance reported it."""
        if "_progress" in self.__dict__:
            return self.__dict__["_progress"]  # type: ignore[no-any-return]
        return store.read_progress(self, QueueProgress)

    def cancel_requested(self) -> bool:
        """Whether this item was asked to stop. No query: a consumer reads the requests
        for the items it runs with each lease renewal (every heartbeat), and ``cancel()``
        on this instance sets it at once."""
        return self.cancel_requested_at is not None


class QueueDependency(models.Model):
    """An edge of a flow: ``item`` waits for ``parent`` (docs/flows.md).

    No foreign-key constraint and no cascade: a purge deletes items in plain batches
    (a cascade would make Django look for edges of every item it purges), and deletes the
    edges of the flow items it removes itself (``store.upkeep``)."""

    # Keyed by the pair, no serial id: two indexes, the key's (lookups by parent, as an
    # acknowledgement counts down what waited for it) and one by item, and no sequence,
    # make a big group's edges about a third cheaper to write.
    pk = models.CompositePrimaryKey("parent", "item")
    parent = models.ForeignKey(
        QueueItem,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        db_index=False,
        related_name="+",
    )
    item = models.ForeignKey(
        QueueItem,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        db_index=False,
        related_name="+",
    )

    class Meta:
        verbose_name = "queue dependency"
        verbose_name_plural = "queue dependencies"
        indexes = [models.Index(fields=["item"], name="txqueue_dependency_item")]

    def __str__(self) -> str:
        return f"#{self.item_id} after #{self.parent_id}"


class QueueFlow(models.Model):
    """Where a flow's items are (docs/flows.md): the first and last primary keys its
    enqueue wrote. All of its items lie between them, beside any others inserted
    meanwhile, so they are read along the primary key (``QueueItemQuerySet.in_flow``),
    which every claim and acknowledgement writes anyway. An index on the items' ``flow``
    would be written by each of them too (on PostgreSQL a row's new version gets an entry
    in every index whose condition it meets): 4-5% of a flow's drain. A purge deletes a
    flow's row with its last item (``store.upkeep``)."""

    id = models.UUIDField(primary_key=True, editable=False)
    first_item = models.BigIntegerField()
    last_item = models.BigIntegerField()

    class Meta:
        verbose_name = "queue flow"

    def __str__(self) -> str:
        return f"flow {self.id}: #{self.first_item} to #{self.last_item}"


class QueueProgress(models.Model):
    """The last progress report of an item's run (``QueueItem.report_progress``). A table
    of its own rather than a column: the claim and the acknowledgement of the items that
    never report are the statements they were, and read no extra column."""

    item = models.OneToOneField(
        QueueItem,
        primary_key=True,
        on_delete=models.DO_NOTHING,
        db_constraint=False,  # finished items are purged in plain batches; see upkeep.purge
        related_name="+",
    )
    # The claim that reported: a later run of the item does not show an earlier one's.
    claim_token = models.BigIntegerField()
    report = models.JSONField()  # {"done", "total", "message"}
    reported_at = models.DateTimeField(db_default=Now())

    class Meta:
        verbose_name = "queue progress report"

    def __str__(self) -> str:
        return f"#{self.item_id}: {self.report}"


class QueuePause(models.Model):
    """One row per paused queue, in the queue's own database: consumers stop claiming
    from it (they read this table with their heartbeat) until it is resumed."""

    queue = models.CharField(max_length=MAX_QUEUE_NAME, primary_key=True)
    paused_at = models.DateTimeField(db_default=Now())

    class Meta:
        verbose_name = "queue pause"

    def __str__(self) -> str:
        return self.queue


class ScheduleTick(models.Model):
    """One row per tick of a ``SCHEDULE`` entry that was enqueued. The unique
    (name, tick) lets exactly one consumer enqueue each tick, however many run."""

    id = models.BigAutoField(primary_key=True)
    name = models.CharField(max_length=MAX_LABEL)
    tick = models.DateTimeField()
    # The item it enqueued (no foreign key: finished items are purged, ticks are kept).
    item_id = models.BigIntegerField(null=True, blank=True)
    enqueued_at = models.DateTimeField(db_default=Now())

    class Meta:
        verbose_name = "schedule tick"
        constraints = [
            models.UniqueConstraint(fields=["name", "tick"], name="txqueue_schedule_tick"),
        ]

    def __str__(self) -> str:
        return f"{self.name} @ {self.tick.isoformat()}"


class Dashboard(QueueItem):
    """No table of its own: the admin's queue dashboard needs a model to sit at
    ``admin/django_txqueue/dashboard/`` and in the app's index. Its pages check the
    QueueItem permissions, so it has none of its own."""

    class Meta:
        proxy = True
        verbose_name = "dashboard"
        verbose_name_plural = "dashboard"
        default_permissions = ()


class Schedule(models.Model):
    """A periodic entry kept in the database, edited in the admin: the same as a
    ``TXQUEUE["SCHEDULE"]`` entry, read by the consumers' schedulers on each look, so that a
    change or a pause takes effect without a deploy (docs/control.md: Periodic items)."""

    class CatchUp(models.TextChoices):
        LATEST = "latest", "the latest missed tick"
        NONE = "none", "none: missed ticks are skipped"

    name = models.CharField(max_length=MAX_LABEL, unique=True)
    # What it enqueues: an item on QUEUE (with PAYLOAD, PRIORITY, KEY), or TASK's task.
    queue = models.CharField(max_length=MAX_QUEUE_NAME, blank=True, default="")
    task = models.CharField(
        max_length=255, blank=True, default="", help_text="A Django Task's dotted path."
    )
    # When: a cron expression (read in TIME_ZONE) or every so many seconds, one of them.
    cron = models.CharField(max_length=255, blank=True, default="")
    every = models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1)], help_text="Seconds."
    )
    payload = models.JSONField(null=True, blank=True, encoder=DjangoJSONEncoder)
    priority = models.IntegerField(default=0)
    key = models.CharField(max_length=MAX_LABEL, blank=True, default="")
    args = models.JSONField(default=list, blank=True, help_text="A TASK's positional arguments.")
    kwargs = models.JSONField(default=dict, blank=True, help_text="A TASK's keyword arguments.")
    catch_up = models.CharField(max_length=6, choices=CatchUp.choices, default=CatchUp.LATEST)
    enabled = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name = "schedule entry"
        verbose_name_plural = "schedule"
        constraints = [
            models.CheckConstraint(
                condition=Q(cron="", every__isnull=False) | (~Q(cron="") & Q(every__isnull=True)),
                name="txqueue_schedule_one_timing",
            ),
        ]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        """What the system checks say of a settings entry, per field (a TASK's path is
        checked by the admin's form, which may load it)."""
        errors: dict[str, list[str]] = {}

        def refuse(field: str, message: str) -> None:
            errors.setdefault(field, []).append(message)

        if self.name and self.name in (conf.get("SCHEDULE") or {}):
            refuse("name", 'TXQUEUE["SCHEDULE"] has an entry of this name; choose another.')
        if bool(self.cron) == (self.every is not None):
            refuse("cron", "Give a cron expression or an interval (every), one of them.")
        elif self.cron and (problem := cron_problem(self.cron)) is not None:
            refuse("cron", problem[0].upper() + problem[1:] + ".")
        if bool(self.queue) == bool(self.task):
            refuse("queue", "Give a queue or a task, one of them.")
        elif self.queue and (problem := queue_name_problem(self.queue)) is not None:
            refuse("queue", problem)
        if self.task:
            for field in ("payload", "key"):
                if getattr(self, field) not in (None, ""):
                    refuse(field, "A task has its own arguments: give them in args and kwargs.")
            if self.priority:
                refuse("priority", "A task has its own priority: set it on the task.")
        else:
            if self.args:
                refuse("args", "Arguments go with a task only.")
            if self.kwargs:
                refuse("kwargs", "Arguments go with a task only.")
        if not isinstance(self.args, list):
            refuse("args", "A list of arguments.")
        if not isinstance(self.kwargs, dict):
            refuse("kwargs", "A dict of keyword arguments.")
        if errors:
            raise ValidationError(errors)
