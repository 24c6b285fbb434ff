"""Turns a queryset into claim and acknowledgement SQL once, and loads claimed rows.

Django compiles the claim's candidate SELECT (filters, order, limit) from the queryset;
the vendor's ``Dialect`` wraps it into its claim statement. Both are cached per claim
shape, so a consumer's claim costs one statement and no ORM work per call.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from datetime import timedelta
from functools import cache, cached_property
from typing import TYPE_CHECKING, Any

from django.db import NotSupportedError, connections
from django.db.models import BooleanField, F, Field, Func, Model
from django.db.models.base import ModelState
from django.db.models.functions import Now
from django.db.models.signals import post_init, pre_init
from django.db.models.sql.subqueries import UpdateQuery
from django.db.models.sql.where import AND

from .. import conf
from ..signals import heard
from ..status import Status
from . import dialect

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.db.models import QuerySet

    from .base import Dialect


def quoted_column(connection: BaseDatabaseWrapper, model: type[Any], name: str) -> str:
    """A field's column (``"pk"`` for the primary key), quoted for ``connection``."""
    field = model._meta.pk if name == "pk" else model._meta.get_field(name)
    return connection.ops.quote_name(str(field.column))


def has_field(model: type[Any], name: str) -> bool:
    """Whether ``model`` has a concrete field ``name`` (a plain QueueModel lacks QueueItem's
    queue, result, last_error...)."""
    return any(field.name == name for field in model._meta.concrete_fields)


def claim_order(queryset: QuerySet[Any]) -> tuple[Any, ...]:
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
    """What differs between two claims of the same shape.

    ``lease`` None means each item's queue's own ``LEASE``. ``after``: claim only items
    that sort after these claim-order values (``ClaimStatement.resume_key``).
    """

    pid: str
    token: int
    lease: timedelta | None
    after: tuple[Any, ...] | None = None


class AfterValue:
    """Stands for the ``index``-th value of ``ClaimValues.after`` in the cached candidate
    SQL's parameters; ``ClaimStatement.bind_after`` puts the values in."""

    def __init__(self, index: int) -> None:
        self.index = index


class SortsAfter(Func):
    """``(a, b, c) > (%s, %s, %s)``: rows after a point in an ascending (a, b, c) order,
    which a btree index on those columns reads as a range starting there."""

    template = "(%(expressions)s) > (%(values)s)"
    conditional = True
    output_field = BooleanField()

    def as_sql(self, compiler: Any, connection: Any, *args: Any, **extra: Any) -> Any:
        count = len(self.source_expressions)
        sql, params = super().as_sql(
            compiler, connection, *args, values=", ".join(["%s"] * count), **extra
        )
        return sql, (*params, *map(AfterValue, range(count)))

    def as_mysql(self, compiler: Any, connection: Any, *args: Any, **extra: Any) -> Any:
        """``a > %s OR (a = %s AND (b > %s OR (b = %s AND c > %s)))``: MySQL and MariaDB
        read a row comparison as a lookup of the index's equal prefix only (``ref``), but
        this as a range starting at the point."""
        columns = [compiler.compile(expression)[0] for expression in self.source_expressions]
        *leading, last = range(len(columns))
        sql, params = f"{columns[last]} > %s", [AfterValue(last)]
        for index in reversed(leading):
            column = columns[index]
            sql = f"{column} > %s OR ({column} = %s AND ({sql}))"
            params = [AfterValue(index), AfterValue(index), *params]
        return f"({sql})", params


class ClaimStatement:
    """One claim shape (a queryset and a limit), compiled by Django once and reused.

    Each claim only assembles the vendor's SQL around cached pieces and binds its own
    values (pid, token, lease). Holds no connection: connections are per thread, the
    SQL text is not.
    """

    def __init__(
        self, queryset: QuerySet[Any], limit: int, *, reads_other_rows: bool = False
    ) -> None:
        """``reads_other_rows``: whether a row is claimable depends on other rows of the
        table (an ordered queue's earlier and running items of the same key)."""
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be a positive integer, got {limit!r}")
        self.reads_other_rows = reads_other_rows
        self.queryset = queryset.ready().order_by(*claim_order(queryset))  # type: ignore[attr-defined]
        self.limit = limit
        self.model: type[Model] = queryset.model
        self.alias: str = queryset.db
        self.order = tuple(self.queryset.query.order_by)
        self._candidates: dict[tuple[str, bool, bool], tuple[str, list[Any]]] = {}
        self._converters: dict[int, list[tuple[int, list[Any], bool]]] = {}
        self._assignments: str | None = None
        self._where_and_order: dict[bool, tuple[str, str, list[Any]]] = {}

    @property
    def connection(self) -> BaseDatabaseWrapper:
        return connections[self.alias]

    @property
    def dialect(self) -> Dialect:
        return dialect(self.connection)

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

    def candidates(
        self, lock: str = "", *, whole_rows: bool = False, after: tuple[Any, ...] | None = None
    ) -> tuple[str, list[Any]]:
        """``SELECT pk`` (or every column, in ``fields`` order) of the first ``limit``
        ready rows in claim order, plus ``lock``; with ``after``, of those that sort after
        it (``resume_key``)."""
        key = (lock, whole_rows, after is not None)
        if key not in self._candidates:
            rows = self.queryset if after is None else self.sorting_after()
            if not whole_rows:
                rows = rows.values_list("pk", flat=True)
            query = rows[: self.limit].query
            sql, params = query.get_compiler(connection=self.connection).as_sql()
            self._candidates[key] = (f"{sql} {lock}".rstrip(), list(params))
        sql, params = self._candidates[key]
        return sql, self.bind_after(params, after)

    def sorting_after(self) -> QuerySet[Any]:
        """The ready rows that sort after a point (``SortsAfter``, values bound later). The
        condition joins the WHERE as it is: ``filter()`` would compare it to true on
        MySQL, which then reads no range of the index."""
        rows: QuerySet[Any] = self.queryset.all()
        condition = SortsAfter(*(F(name) for name in self.order))
        rows.query.where.add(condition.resolve_expression(rows.query), AND)
        return rows

    def bind_after(self, params: list[Any], after: tuple[Any, ...] | None) -> list[Any]:
        """``params`` with each ``AfterValue`` replaced by its value of ``after``, made
        ready for the database as its field would (aware datetimes, for one)."""
        if after is None:
            return list(params)
        connection = self.connection
        values = [
            field.get_db_prep_value(value, connection)
            for field, value in zip(self.order_fields, after, strict=True)
        ]
        return [values[p.index] if isinstance(p, AfterValue) else p for p in params]

    @cached_property
    def order_fields(self) -> list[Field[Any, Any]]:
        """The fields of the claim order, in order (``pk`` too)."""
        meta = self.model._meta
        fields = [meta.pk if name == "pk" else meta.get_field(name) for name in self.order]
        return [field for field in fields if isinstance(field, Field)]

    @cached_property
    def resumable(self) -> bool:
        """Whether a claim can start after the last item claimed (``resume_key``): its
        order is ascending on fields only."""
        return all(isinstance(name, str) and not name.startswith("-") for name in self.order)

    def resume_key(self, item: Any) -> tuple[Any, ...]:
        """``item``'s values of the claim order: where a claim after it starts."""
        return tuple(getattr(item, name) for name in self.order)

    def where_and_order(self, after: tuple[Any, ...] | None = None) -> tuple[str, str, list[Any]]:
        """The ready filter and the ORDER BY on their own, for a single-table UPDATE; with
        ``after``, of the rows that sort after it."""
        key = after is not None
        if key not in self._where_and_order:
            rows = self.queryset if after is None else self.sorting_after()
            query = rows.query.clone()
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
            self._where_and_order[key] = (where, order, [*params, *order_params])
        where, order, params = self._where_and_order[key]
        return where, order, self.bind_after(params, after)

    def assignments(self, values: ClaimValues) -> tuple[str, list[Any]]:
        """The SET clause: IN_PROGRESS under this claim, attempt counted, lease from now."""
        if self._assignments is None:
            attempts = self.column("attempts")
            self._assignments = (
                f"{self.column('status')} = %s, {self.column('pid')} = %s, "
                f"{self.column('claim_token')} = %s, {attempts} = {attempts} + 1, "
                f"{self.column('claimed_at')} = {now_sql(self.connection)}, "
                f"{self.column('lease_expires_at')} = "
            )
        lease, lease_params = self.lease_expiry(values.lease)
        params = [int(Status.IN_PROGRESS), values.pid, values.token]
        return self._assignments + lease, params + lease_params

    def lease_expiry(self, lease: timedelta | None) -> tuple[str, list[Any]]:
        """The new ``lease_expires_at``: now plus ``lease``, or plus each row's queue's
        ``LEASE`` (a CASE over the queues that override it) when ``lease`` is None."""
        dialect = self.dialect
        expiry = dialect.lease_expiry(now_sql(self.connection))
        overrides = conf.lease_overrides() if lease is None and self.has_queues else {}
        default = dialect.lease_param(conf.lease() if lease is None else lease)
        if not overrides:
            return expiry, [default]
        params: list[Any] = []
        for name, queue_lease in overrides.items():
            params += [name, dialect.lease_param(queue_lease)]
        cases = f"WHEN {self.column('queue')} = %s THEN {expiry} " * len(overrides)
        return f"CASE {cases}ELSE {expiry} END", [*params, default]

    @cached_property
    def ready_index(self) -> str | None:
        """The name of the model's READY ``StatusIndex`` (built for the claim order), if any.

        A proxy model's Meta has no indexes of its own: its table's are its concrete model's.
        """
        model = self.model._meta.concrete_model or self.model
        for index in model._meta.indexes:
            # Only a StatusIndex has a status (models.py imports this module, not the reverse).
            if getattr(index, "status", None) == Status.READY:
                return str(index.name)
        return None

    @cached_property
    def has_queues(self) -> bool:
        return has_field(self.model, "queue")

    def fetch(self, sql: str, params: list[Any]) -> list[Any]:
        """Run a statement that returns whole rows (``columns()``) and ``load`` them."""
        with self.connection.cursor() as cursor:
            cursor.execute(sql, params)
            return self.load(cursor.fetchall())

    def load(self, rows: list[Any]) -> list[Any]:
        """Instances of rows of ``columns()``: each column converted as Django converts
        it, then the instance built directly when nothing could tell that from
        ``Model.from_db`` (which costs a ``setattr`` per field and two signals per row),
        else through ``from_db``."""
        connection = self.connection
        converters = self.converters(connection)
        fields = self.fields
        build = self.build if self.plain else self.from_db
        items = []
        for row in rows:
            values = list(row)
            for index, functions, keeps_none in converters:
                if values[index] is None and keeps_none:
                    continue
                for convert in functions:
                    values[index] = convert(values[index], fields[index], connection)
            items.append(build(values))
        return items

    def from_db(self, values: list[Any]) -> Any:
        return self.model.from_db(self.alias, self.attnames, values)

    def build(self, values: list[Any]) -> Any:
        """The instance ``from_db`` would make: the same ``_state``, first, as in
        ``Model.__init__``, then each value where ``__init__`` stores it."""
        state = ModelState()
        state.adding, state.db = False, self.alias
        item = object.__new__(self.model)
        item.__dict__ = {"_state": state}
        item.__dict__.update(zip(self.attnames, values, strict=True))
        return item

    @cached_property
    def attnames(self) -> list[str]:
        return [field.attname for field in self.fields]

    @property
    def plain(self) -> bool:
        return builds_plainly(self.model)

    @staticmethod
    def mark_claimed(items: list[Any], values: ClaimValues) -> list[Any]:
        """Give rows read before their claiming UPDATE the values it wrote.

        The times it set by the database clock are left deferred: loaded on first access.
        """
        for item in items:
            # A plain int, as a row read back holds, not the Status member.
            item.status, item.pid, item.claim_token = (
                int(Status.IN_PROGRESS),
                values.pid,
                values.token,
            )
            item.attempts += 1
            item.__dict__.pop("claimed_at", None)
            item.__dict__.pop("lease_expires_at", None)
        return items

    def converters(self, connection: BaseDatabaseWrapper) -> list[tuple[int, list[Any], bool]]:
        """Django's per-field value converters for this connection, looked up once, and
        whether they leave NULL as None, so that a NULL needs no call: the backends' own
        converters and those of Django's fields do (most columns of a claimed row are
        NULL: its key, result, finish time...); a field of another package may not."""
        key = id(connection)
        if key not in self._converters:
            found = []
            for index, field in enumerate(self.fields):
                column = field.get_col(self.model._meta.db_table)
                own = field.get_db_converters(connection)
                functions = connection.ops.get_db_converters(column) + own
                if functions:
                    keeps_none = not own or type(field).__module__.startswith("django.")
                    found.append((index, functions, keeps_none))
            self._converters[key] = found
        return self._converters[key]


def builds_plainly(model: type[Model]) -> bool:
    """Whether ``Model.from_db`` and ``model(**values)`` come to storing each value in
    ``__dict__``, so that an instance may be built that way directly: no receiver of
    ``pre_init`` / ``post_init`` for the model (asked each time, as they may connect
    later), and, fixed per model, no ``from_db`` or ``__init__`` of its own and no field
    that intercepts assignment."""
    return _plain_model(model) and not heard(pre_init, model) and not heard(post_init, model)


@cache
def _plain_model(model: type[Model]) -> bool:
    return (
        model.from_db.__func__ is Model.from_db.__func__  # type: ignore[attr-defined]
        and model.__init__ is Model.__init__
        and not any(
            hasattr(getattr(model, field.attname, None), "__set__")
            for field in model._meta.concrete_fields
        )
    )


_now_sql: dict[str, str] = {}


def now_sql(connection: BaseDatabaseWrapper) -> str:
    """The database clock as SQL, as Django's ``Now()`` writes it for this vendor."""
    if connection.vendor not in _now_sql:
        compiler = UpdateQuery(None).get_compiler(connection=connection)
        sql, params = compiler.compile(Now())
        assert not params  # noqa: S101 - Now() takes none
        _now_sql[connection.vendor] = sql
    return _now_sql[connection.vendor]


_ack_sql: dict[tuple[Any, ...], str] = {}


def ack_sql(model: type[Model], connection: BaseDatabaseWrapper, size: int, results: bool) -> str:
    """The fenced batch acknowledgement (``Dialect.ack_sql``), built once per model,
    vendor, size and shape."""
    key = (model, connection.vendor, size, results)
    if key not in _ack_sql:
        names = ["pk", "status", "lease_expires_at", "claim_token"]
        if has_field(model, "result"):
            names += ["result", "finished_at"]
        columns = {name: quoted_column(connection, model, name) for name in names}
        table = connection.ops.quote_name(model._meta.db_table)
        _ack_sql[key] = dialect(connection).ack_sql(
            table, columns, now_sql(connection), size, results
        )
    return _ack_sql[key]
