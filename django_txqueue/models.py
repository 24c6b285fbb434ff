"""Status, the abstract QueueModel, the QueueItem table and the Consumer registry.

State changes are small fenced UPDATEs: each one names the claim token it expects,
so a consumer whose claim was taken over changes nothing and learns it from the
return value (DESIGN section 3). Vendor SQL lives in ``claim/``, not here.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from django.core.serializers.json import DjangoJSONEncoder
from django.db import models
from django.db.models import Case, F, Q, Value, When
from django.db.models.functions import Now

from . import conf, retry

if TYPE_CHECKING:
    from django.db.backends.base.schema import BaseDatabaseSchemaEditor
    from django.db.backends.ddl_references import Statement

_M = TypeVar("_M", bound="QueueModel")


class Status(models.IntegerChoices):
    READY = 1, "ready"
    IN_PROGRESS = 2, "in progress"
    DONE = 3, "done"
    FAILED = 4, "failed"


class StatusIndex(models.Index):
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

    def create_sql(
        self,
        model: type[models.Model],
        schema_editor: BaseDatabaseSchemaEditor,
        using: str = "",
        **kwargs: Any,
    ) -> Statement:
        if schema_editor.connection.features.supports_partial_indexes:
            index = models.Index(
                fields=list(self.fields), name=self.name, condition=Q(status=self.status)
            )
        else:
            index = models.Index(fields=["status", *self.fields], name=self.name)
        return index.create_sql(model, schema_editor, using=using, **kwargs)


def now_plus(wait: timedelta) -> Any:
    """The database clock plus ``wait``, as an expression.

    A zero wait is plain ``Now()``: SQLite's arithmetic result has microsecond digits
    that its millisecond ``Now()`` would compare as later, within the same millisecond.
    """
    return Now() + wait if wait else Now()


def defer_computed(instance: models.Model) -> None:
    """Fields still holding an expression (the database computed their value and did not
    return it) become deferred: Django loads them on first access."""
    for field in instance._meta.concrete_fields:
        if hasattr(instance.__dict__.get(field.attname), "resolve_expression"):
            del instance.__dict__[field.attname]


def check_json(value: Any, what: str) -> None:
    """Raise TypeError naming the type that Django's JSON encoder cannot serialise."""
    try:
        json.dumps(value, cls=DjangoJSONEncoder)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what} is not JSON-serialisable: {exc}") from exc


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
        dead = Consumer.objects.dead().values("identity")
        return self.in_progress().filter(Q(lease_expires_at__lt=Now()) | Q(pid__in=dead))

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
        ``claim_order``). See DESIGN section 3 for the two strategies.
        """
        from .claim import ClaimStatement

        return ClaimStatement(self, limit).run(pid=pid, strategy=strategy, lease=lease)

    def requeue_stuck(self) -> int:
        """Put stuck items back to READY; returns how many."""
        return self.stuck().update(**UNCLAIMED, status=Status.READY)


# Clears a claim, so that its holder's fenced acknowledgements change nothing.
UNCLAIMED: dict[str, Any] = {"pid": "", "claim_token": None, "lease_expires_at": None}


class QueueModel(models.Model):
    """Abstract base that makes any table a queue (seed 003's STATUS and PID columns).

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
        return self._settle(status=Status.DONE, lease_expires_at=None)

    def release(self) -> bool:
        """Put the item back READY without counting the attempt."""
        return self._settle(status=Status.READY, attempts=F("attempts") - 1, **UNCLAIMED)

    def fail(self, error: str | None = None) -> bool:
        """Mark the item FAILED. QueueModel has no column for ``error``; QueueItem keeps it."""
        return self._settle(status=Status.FAILED, lease_expires_at=None)

    def _settle(self, **changes: Any) -> bool:
        """Apply ``changes`` only if the row is still IN_PROGRESS under this claim."""
        if self.claim_token is None or self.status != Status.IN_PROGRESS:
            return False
        changed = (
            type(self)
            ._base_manager.using(self._state.db)
            .filter(pk=self.pk, status=Status.IN_PROGRESS, claim_token=self.claim_token)
            .update(**changes)
        )
        if changed:
            for name, value in changes.items():
                setattr(self, name, value)
            defer_computed(self)
        return bool(changed)


class QueueItemQuerySet(QueueQuerySet["QueueItem"]):
    def ready(self) -> QueueItemQuerySet:
        """READY items whose ``run_at`` has come (database clock)."""
        return self.filter(status=Status.READY, run_at__lte=Now())

    def requeue_stuck(self, *, fail: bool = False) -> int:
        """Stuck items go back to READY, or FAILED when their attempts are spent.

        ``fail=True`` fails them all at once, for work that must never run twice.
        """
        failing = Q(pk__isnull=False) if fail else Q(attempts__gte=F("max_attempts"))
        reason = "stuck: lease expired or consumer died" + ("" if fail else ", attempts spent")
        return self.stuck().update(
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
        )

    def ack_many(self, results: dict[int, Any], claim_token: int) -> int:
        """Mark DONE, in one statement, the items of one claim: ``{pk: result}``.

        Fenced like ``ack``: only rows still IN_PROGRESS under ``claim_token`` change.
        Returns how many did.
        """
        from .claim import ack_batch

        return ack_batch(self.model, self.db, claim_token, results) if results else 0

    def renew_leases(self, tokens: dict[int, int], lease: timedelta) -> int:
        """Push the leases of in-flight items ``{pk: claim_token}`` to now + ``lease``."""
        if not tokens:
            return 0
        held = Q()
        for pk, token in tokens.items():
            held |= Q(pk=pk, claim_token=token)
        return self.filter(held, status=Status.IN_PROGRESS).update(lease_expires_at=Now() + lease)


class QueueItem(QueueModel):
    """The app's own generic queue table: one row per unit of work."""

    claim_order: ClassVar[tuple[str, ...]] = ("priority", "run_at", "pk")

    id = models.BigAutoField(primary_key=True)
    queue = models.CharField(max_length=100)
    payload = models.JSONField(encoder=DjangoJSONEncoder, null=True, blank=True)
    priority = models.IntegerField(default=0, help_text="Lower runs first.")
    run_at = models.DateTimeField(db_default=Now(), help_text="Not before.")
    # NULL, not "", means "none": the unique index below ignores NULLs.
    key = models.CharField(max_length=255, null=True, blank=True)  # noqa: DJ001
    dedup_key = models.CharField(max_length=255, null=True, blank=True)  # noqa: DJ001
    # dedup_key while the item is unfinished, else NULL: a plain unique index on it
    # holds "one unfinished item per dedup_key" on every vendor, MySQL included.
    active_dedup_key = models.GeneratedField(
        expression=Case(
            When(status__in=[Status.READY, Status.IN_PROGRESS], then=F("dedup_key")),
            default=None,
        ),
        output_field=models.CharField(max_length=255, null=True),
        db_persist=True,
    )
    max_attempts = models.PositiveIntegerField(default=5)
    last_error = models.TextField(blank=True, default="")
    result = models.JSONField(encoder=DjangoJSONEncoder, null=True, blank=True)
    created_at = models.DateTimeField(db_default=Now())
    finished_at = models.DateTimeField(null=True, blank=True)

    objects = QueueItemQuerySet.as_manager()  # type: ignore[misc]

    class Meta:
        verbose_name = "queue item"
        indexes = [
            StatusIndex(
                status=Status.READY,
                fields=["queue", "priority", "run_at", "id"],
                name="txqueue_item_ready",
            ),
            StatusIndex(
                status=Status.IN_PROGRESS, fields=["claim_token"], name="txqueue_item_claimed"
            ),
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["queue", "active_dedup_key"], name="txqueue_item_unique_dedup"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.queue} #{self.pk}"

    def ack(self, result: Any = None) -> bool:
        """Mark the item DONE with ``result`` (JSON) if this claim still holds it."""
        check_json(result, "result")
        return self._settle(
            status=Status.DONE, result=result, finished_at=Now(), lease_expires_at=None
        )

    def fail(self, error: str | None = None) -> bool:
        """Mark the item FAILED, keeping ``error``, if this claim still holds it."""
        return self._settle(
            status=Status.FAILED, last_error=error or "", finished_at=Now(), lease_expires_at=None
        )

    def retry(self, error: str | None = None, delay: float | timedelta | None = None) -> bool:
        """Put the item back READY after ``delay`` (default: back-off with jitter).

        Once ``max_attempts`` claims have been spent it ends FAILED with ``error`` instead.
        """
        if self.attempts >= self.max_attempts:
            return self.fail(error)
        wait = (
            conf.to_timedelta(delay, "delay")
            if delay is not None
            else retry.backoff(self.attempts, conf.get("RETRY_DELAY"), conf.get("RETRY_MAX_DELAY"))
        )
        return self._settle(
            **UNCLAIMED, status=Status.READY, run_at=now_plus(wait), last_error=error or ""
        )
