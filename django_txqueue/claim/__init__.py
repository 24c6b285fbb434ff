"""Claiming: picks the strategy for the connected database and runs the vendor's SQL.

This package is the only place that differs by database vendor. ``__init__`` decides
("auto" becomes a concrete strategy from the connection's features) and builds the
pieces every vendor needs from the queryset (the candidate SELECT, the SET clause,
the column list), so each vendor module only assembles its own statement(s):

- ``postgresql``: one ``WITH ... FOR UPDATE SKIP LOCKED ... UPDATE ... RETURNING``.
- ``mysql``: ``SELECT ... FOR UPDATE SKIP LOCKED`` then ``UPDATE``, or the native
  ``UPDATE ... ORDER BY ... LIMIT`` read back by the claim's own token.
- ``sqlite``: one ``UPDATE ... WHERE id IN (SELECT ... LIMIT n) RETURNING``.
"""

from __future__ import annotations

import importlib
import operator
import random
import secrets
import time
from dataclasses import dataclass, field
from datetime import timedelta
from types import ModuleType
from typing import TYPE_CHECKING, Any

from django.db import NotSupportedError, OperationalError, connections
from django.db.models import F
from django.db.models.functions import Now
from django.db.models.sql.subqueries import UpdateQuery

from .. import conf
from ..models import Status, consumer_identity

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper

    from ..models import QueueModel, QueueQuerySet

# A deadlock or lock-wait timeout (MySQL), or a busy SQLite file past its timeout, is
# retried this many times with a short jittered pause before it reaches the caller.
TRANSIENT_RETRIES = 5


def vendor_sql(connection: BaseDatabaseWrapper) -> ModuleType:
    """The module holding this connection's vendor SQL."""
    return importlib.import_module(f"{__name__}.{connection.vendor}")


def resolve_strategy(strategy: str, connection: BaseDatabaseWrapper) -> str:
    """Turn "auto" into the best strategy this connection supports; check the others."""
    if strategy not in conf.STRATEGIES:
        raise ValueError(
            f"unknown claim strategy {strategy!r}; choose one of {', '.join(conf.STRATEGIES)}"
        )
    if strategy == "auto":
        strategy = conf.get("CLAIM_STRATEGY")
    skip_locked = connection.features.has_select_for_update_skip_locked
    if strategy == "auto":
        return "skip_locked" if skip_locked else "update_limit"
    if strategy == "skip_locked" and not skip_locked:
        raise NotSupportedError(
            f"claim strategy 'skip_locked' needs SELECT ... FOR UPDATE SKIP LOCKED, which "
            f"{connection.display_name} does not have; use 'update_limit' or 'auto'"
        )
    return strategy


def claim(
    queryset: QueueQuerySet[Any],
    limit: int,
    *,
    pid: str | None,
    strategy: str,
    lease: float | timedelta | None,
) -> list[Any]:
    """Claim up to ``limit`` ready rows of ``queryset``; see ``QueueQuerySet.claim``."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be a positive integer, got {limit!r}")
    if pid is not None and (not isinstance(pid, str) or not 1 <= len(pid) <= 255):
        raise ValueError(f"pid must be a string of 1 to 255 characters, got {pid!r}")
    duration = conf.to_timedelta(conf.get("LEASE") if lease is None else lease, "lease")
    connection = connections[queryset.db]
    statement = ClaimStatement(
        queryset=queryset.ready().order_by(*claim_order(queryset)),
        limit=limit,
        connection=connection,
        pid=pid or consumer_identity(),
        lease=duration,
    )
    vendor = vendor_sql(connection)
    run = getattr(vendor, f"claim_{resolve_strategy(strategy, connection)}")
    owns_transaction = not connection.in_atomic_block
    for attempt in range(TRANSIENT_RETRIES + 1):
        try:
            items: list[QueueModel] = run(statement)
            break
        except OperationalError as exc:
            # Inside the caller's transaction the failed statement may have rolled the
            # whole transaction back: only the caller can retry that.
            if (
                not owns_transaction
                or attempt == TRANSIENT_RETRIES
                or not vendor.is_transient(exc)
            ):
                raise
            time.sleep(random.uniform(0.005, 0.02) * 2**attempt)
    return sort_items(items, statement.order)


def claim_order(queryset: QueueQuerySet[Any]) -> tuple[Any, ...]:
    """The queryset's explicit ``order_by``, else Meta.ordering, else ``claim_order``."""
    if queryset.query.order_by:
        return tuple(queryset.query.order_by)
    return tuple(queryset.model._meta.ordering) or queryset.model.claim_order


def sort_items(items: list[Any], order: tuple[Any, ...]) -> list[Any]:
    """Put claimed rows back in claim order (RETURNING gives no order)."""
    if not all(isinstance(name, str) for name in order):
        return items
    for name in reversed(order):
        attname = name.lstrip("-")
        items.sort(key=operator.attrgetter(attname), reverse=name.startswith("-"))
    return items


@dataclass
class ClaimStatement:
    """The vendor-neutral pieces of one claim, compiled by Django from the queryset."""

    queryset: QueueQuerySet[Any]
    limit: int
    connection: BaseDatabaseWrapper
    pid: str
    lease: timedelta
    token: int = field(default_factory=lambda: secrets.randbits(63))

    @property
    def model(self) -> type[QueueModel]:
        return self.queryset.model

    @property
    def order(self) -> tuple[Any, ...]:
        return tuple(self.queryset.query.order_by)

    def quote(self, name: str) -> str:
        return self.connection.ops.quote_name(name)

    @property
    def table(self) -> str:
        return self.quote(self.model._meta.db_table)

    @property
    def pk(self) -> str:
        return self.column("pk")

    def column(self, name: str) -> str:
        field = self.model._meta.pk if name == "pk" else self.model._meta.get_field(name)
        return self.quote(str(field.column))  # type: ignore[union-attr]

    def columns(self, *, qualified: bool = True) -> str:
        """Every column of the model, for RETURNING or a read-back."""
        prefix = f"{self.table}." if qualified else ""
        return ", ".join(
            prefix + self.quote(str(f.column)) for f in self.model._meta.concrete_fields
        )

    def candidates(self, lock: str = "") -> tuple[str, list[Any]]:
        """``SELECT pk`` of the first ``limit`` ready rows in claim order, plus ``lock``."""
        query = self.queryset.values_list("pk", flat=True)[: self.limit].query
        sql, params = query.get_compiler(connection=self.connection).as_sql()
        return f"{sql} {lock}".rstrip(), list(params)

    def where_and_order(self) -> tuple[str, str, list[Any]]:
        """The ready filter and the ORDER BY on their own, for a single-table UPDATE."""
        query = self.queryset.query.clone()
        compiler = query.get_compiler(connection=self.connection)
        _, order_by, _ = compiler.pre_sql_setup()
        if len(query.alias_map) > 1:
            raise NotSupportedError(
                "claim strategy 'update_limit' cannot filter through a join on "
                f"{self.connection.display_name}; use 'skip_locked' or filter on own columns"
            )
        where, params = compiler.compile(compiler.where)
        order = ", ".join(sql for _, (sql, _, _) in order_by)
        order_params = [p for _, (_, ps, _) in order_by for p in ps]
        return where, order, [*params, *order_params]

    def assignments(self) -> tuple[str, list[Any]]:
        """The SET clause: IN_PROGRESS under this claim, attempt counted, lease from now."""
        values: dict[str, Any] = {
            "status": Status.IN_PROGRESS,
            "pid": self.pid,
            "claim_token": self.token,
            "attempts": F("attempts") + 1,
            "claimed_at": Now(),
            "lease_expires_at": Now() + self.lease,
        }
        query = UpdateQuery(self.model)
        compiler = query.get_compiler(connection=self.connection)
        parts, params = [], []
        for name, value in values.items():
            if hasattr(value, "resolve_expression"):
                sql, value_params = compiler.compile(
                    value.resolve_expression(query, allow_joins=False, for_save=True)
                )
            else:
                sql, value_params = "%s", [value]
            parts.append(f"{self.column(name)} = {sql}")
            params.extend(value_params)
        return ", ".join(parts), params

    def fetch(self, sql: str, params: list[Any]) -> list[Any]:
        """Run a statement that returns whole rows and load them as model instances."""
        manager = self.model._base_manager.db_manager(self.connection.alias)
        return list(manager.raw(sql, params))
