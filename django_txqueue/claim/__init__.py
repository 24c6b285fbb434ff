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
from dataclasses import dataclass
from datetime import timedelta
from functools import cached_property
from types import ModuleType
from typing import TYPE_CHECKING, Any

from django.db import NotSupportedError, OperationalError, connections
from django.db.models.functions import Now
from django.db.models.sql.subqueries import UpdateQuery

from .. import conf
from ..models import Consumer, Status, consumer_identity

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper

    from ..models import QueueItem, QueueModel, QueueQuerySet

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


def quoted_column(connection: BaseDatabaseWrapper, model: type[Any], name: str) -> str:
    """A field's column (``"pk"`` for the primary key), quoted for ``connection``."""
    field = model._meta.pk if name == "pk" else model._meta.get_field(name)
    return connection.ops.quote_name(str(field.column))


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


@dataclass(frozen=True)
class ClaimValues:
    """What differs between two claims of the same shape."""

    pid: str
    token: int
    lease: timedelta


class ClaimStatement:
    """One claim shape (a queryset and a limit), compiled by Django once and reused.

    ``Queue`` keeps these, so a consumer's claim costs one statement and no ORM work:
    each call only assembles the vendor's SQL around cached pieces and binds the
    claim's own values (pid, token, lease). Holds no connection: connections are per
    thread, the SQL text is not.
    """

    def __init__(self, queryset: QueueQuerySet[Any], limit: int) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be a positive integer, got {limit!r}")
        self.queryset = queryset.ready().order_by(*claim_order(queryset))
        self.limit = limit
        self.model: type[QueueModel] = queryset.model
        self.alias: str = queryset.db
        self.order = tuple(self.queryset.query.order_by)
        self._candidates: dict[tuple[str, bool], tuple[str, list[Any]]] = {}
        self._converters: dict[int, list[tuple[int, list[Any]]]] = {}
        self._assignments: str | None = None
        self._where_and_order: tuple[str, str, list[Any]] | None = None

    @property
    def connection(self) -> BaseDatabaseWrapper:
        return connections[self.alias]

    def run(self, *, pid: str | None, strategy: str, lease: float | timedelta | None) -> list[Any]:
        """Claim now: validate, pick the strategy, retry transient lock errors."""
        if pid is not None and (not isinstance(pid, str) or not 1 <= len(pid) <= 255):
            raise ValueError(f"pid must be a string of 1 to 255 characters, got {pid!r}")
        duration = conf.to_timedelta(conf.get("LEASE") if lease is None else lease, "lease")
        connection = self.connection
        vendor = vendor_sql(connection)
        run = getattr(vendor, f"claim_{resolve_strategy(strategy, connection)}")
        values = ClaimValues(pid or consumer_identity(), secrets.randbits(63), duration)
        owns_transaction = not connection.in_atomic_block
        for attempt in range(TRANSIENT_RETRIES + 1):
            try:
                items: list[QueueModel] = run(self, values)
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
        return sort_items(items, self.order)

    def quote(self, name: str) -> str:
        return self.connection.ops.quote_name(name)

    @cached_property
    def table(self) -> str:
        return self.quote(self.model._meta.db_table)

    @cached_property
    def pk(self) -> str:
        return self.column("pk")

    def column(self, name: str) -> str:
        return quoted_column(self.connection, self.model, name)

    @cached_property
    def fields(self) -> list[Any]:
        return list(self.model._meta.concrete_fields)

    def columns(self, *, qualified: bool = True) -> str:
        """Every column of the model, for RETURNING or a read-back."""
        return self._qualified_columns if qualified else self._columns

    @cached_property
    def _columns(self) -> str:
        return ", ".join(self.quote(str(f.column)) for f in self.fields)

    @cached_property
    def _qualified_columns(self) -> str:
        return ", ".join(f"{self.table}.{self.quote(str(f.column))}" for f in self.fields)

    def candidates(self, lock: str = "", *, whole_rows: bool = False) -> tuple[str, list[Any]]:
        """``SELECT pk`` (or every column, in ``fields`` order) of the first ``limit``
        ready rows in claim order, plus ``lock``."""
        key = (lock, whole_rows)
        if key not in self._candidates:
            rows = self.queryset if whole_rows else self.queryset.values_list("pk", flat=True)
            query = rows[: self.limit].query
            sql, params = query.get_compiler(connection=self.connection).as_sql()
            self._candidates[key] = (f"{sql} {lock}".rstrip(), list(params))
        sql, params = self._candidates[key]
        return sql, list(params)

    def where_and_order(self) -> tuple[str, str, list[Any]]:
        """The ready filter and the ORDER BY on their own, for a single-table UPDATE."""
        if self._where_and_order is None:
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
            self._where_and_order = (where, order, [*params, *order_params])
        where, order, params = self._where_and_order
        return where, order, list(params)

    def assignments(self, values: ClaimValues) -> tuple[str, list[Any]]:
        """The SET clause: IN_PROGRESS under this claim, attempt counted, lease from now."""
        vendor = vendor_sql(self.connection)
        if self._assignments is None:
            now = now_sql(self.connection)
            attempts = self.column("attempts")
            self._assignments = (
                f"{self.column('status')} = %s, {self.column('pid')} = %s, "
                f"{self.column('claim_token')} = %s, {attempts} = {attempts} + 1, "
                f"{self.column('claimed_at')} = {now}, "
                f"{self.column('lease_expires_at')} = {vendor.lease_expiry(now)}"
            )
        params = [Status.IN_PROGRESS, values.pid, values.token, vendor.lease_param(values.lease)]
        return self._assignments, params

    def fetch(self, sql: str, params: list[Any]) -> list[Any]:
        """Run a statement that returns whole rows (``columns()``) and load them."""
        connection = self.connection
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            rows = cursor.fetchall()
        converters = self.converters(connection)
        names = [field.attname for field in self.fields]
        items = []
        for row in rows:
            values = list(row)
            for index, functions in converters:
                for convert in functions:
                    values[index] = convert(values[index], self.fields[index], connection)
            items.append(self.model.from_db(self.alias, names, values))
        return items

    @staticmethod
    def mark_claimed(items: list[Any], values: ClaimValues) -> list[Any]:
        """Give rows read before their claiming UPDATE the values it wrote.

        The times it set by the database clock are left deferred: loaded on first access.
        """
        for item in items:
            item.status, item.pid, item.claim_token = Status.IN_PROGRESS, values.pid, values.token
            item.attempts += 1
            item.__dict__.pop("claimed_at", None)
            item.__dict__.pop("lease_expires_at", None)
        return items

    def converters(self, connection: BaseDatabaseWrapper) -> list[tuple[int, list[Any]]]:
        """Django's per-field value converters for this connection, looked up once."""
        key = id(connection)
        if key not in self._converters:
            found = []
            for index, field in enumerate(self.fields):
                column = field.get_col(self.model._meta.db_table)
                functions = connection.ops.get_db_converters(column) + field.get_db_converters(
                    connection
                )
                if functions:
                    found.append((index, functions))
            self._converters[key] = found
        return self._converters[key]


_now_sql: dict[str, str] = {}


def now_sql(connection: BaseDatabaseWrapper) -> str:
    """The database clock as SQL, as Django's ``Now()`` writes it for this vendor."""
    if connection.vendor not in _now_sql:
        compiler = UpdateQuery(Consumer).get_compiler(connection=connection)
        sql, params = compiler.compile(Now())
        assert not params  # noqa: S101 - Now() takes none
        _now_sql[connection.vendor] = sql
    return _now_sql[connection.vendor]


def ack_batch(
    model: type[QueueItem], alias: str, claim_token: int, results: dict[int, Any]
) -> int:
    """Mark DONE, in one fenced UPDATE, items of one claim: ``{pk: result}``.

    Only rows still IN_PROGRESS under ``claim_token`` change; returns how many did.
    The other half of DESIGN section 11's budget: one acknowledgement per batch.
    """
    connection = connections[alias]
    with_results = any(value is not None for value in results.values())
    sql = ack_sql(model, connection, len(results), with_results)
    params: list[Any] = [Status.DONE]
    if with_results:
        field: Any = model._meta.get_field("result")
        for item_pk, value in results.items():
            params += [item_pk, field.get_db_prep_save(value, connection)]
    params += [*results, Status.IN_PROGRESS, claim_token]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return int(cursor.rowcount)


_ack_sql: dict[tuple[Any, ...], str] = {}


def ack_sql(
    model: type[QueueItem], connection: BaseDatabaseWrapper, size: int, results: bool
) -> str:
    """The batch acknowledgement's SQL, built once per model, vendor, size and shape."""
    key = (model, connection.vendor, size, results)
    if key not in _ack_sql:

        def column(name: str) -> str:
            return quoted_column(connection, model, name)

        pk = column("pk")
        table = connection.ops.quote_name(model._meta.db_table)
        result = "CASE " + f"WHEN {pk} = %s THEN %s " * size + "END" if results else "NULL"
        _ack_sql[key] = (
            f"UPDATE {table} SET {column('status')} = %s, "
            f"{column('result')} = {result}, {column('finished_at')} = {now_sql(connection)}, "
            f"{column('lease_expires_at')} = NULL "
            f"WHERE {pk} IN ({', '.join(['%s'] * size)}) "
            f"AND {column('status')} = %s AND {column('claim_token')} = %s"
        )
    return _ack_sql[key]
