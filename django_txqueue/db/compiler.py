"""Turns a queryset into the pieces of its claim SQL once.

Django compiles the claim's candidate SELECT (filters, order, limit) from the queryset;
the vendor's ``Dialect`` wraps it into its claim statement. The pieces are cached per
claim shape, so a consumer's claim costs one statement and no ORM work per call. Only
SQL that Django writes for every vendor is made here: this module knows no dialect.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from functools import cached_property
from typing import TYPE_CHECKING, Any

from django.db import NotSupportedError, connections
from django.db.models import BooleanField, F, Field, Func, Model
from django.db.models.sql.where import AND

from ..status import Status
from .rows import Rows, has_field, now_sql, quoted_column

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.db.models import QuerySet


def claim_order(queryset: QuerySet[Any]) -> tuple[Any, ...]:
    """The queryset's explicit ``order_by``, else Meta.ordering, else ``claim_order``."""
    if queryset.query.order_by:
        return tuple(queryset.query.order_by)
    return tuple(queryset.model._meta.ordering) or queryset.model.claim_order


@dataclass(frozen=True)
class ClaimValues:
    """What differs between two claims of the same shape.

    ``lease``: how long the claimed items are held; ``lease_by_queue``, where one claim
    takes items of several queues, the queues whose ``LEASE`` differs from it (the store
    resolves both). ``after``: claim only items that sort after these claim-order values
    (``ClaimStatement.resume_key``).
    """

    pid: str
    token: int
    lease: timedelta
    after: tuple[Any, ...] | None = None
    lease_by_queue: Mapping[str, timedelta] = field(default_factory=dict)


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
        self,
        queryset: QuerySet[Any],
        limit: int,
        *,
        queue: str | None = None,
        reads_other_rows: bool = False,
    ) -> None:
        """``queue``: the one queue whose items ``queryset`` holds, if it is one.
        ``reads_other_rows``: whether a row is claimable depends on other rows of the
        table (an ordered queue's earlier and running items of the same key)."""
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be a positive integer, got {limit!r}")
        self.queue = queue
        self.reads_other_rows = reads_other_rows
        self.queryset = queryset.ready().order_by(*claim_order(queryset))  # type: ignore[attr-defined]
        self.limit = limit
        self.model: type[Model] = queryset.model
        self.alias: str = queryset.db
        self.order = tuple(self.queryset.query.order_by)
        self.rows = Rows(self.model, self.alias, self.order)
        # The dialects' whole claim SQL, by the shape they give it (its lock, whether it
        # resumes, the queues leased apart...), built on first use: a claim binds values.
        self.sql: dict[Hashable, str] = {}
        self._candidates: dict[tuple[str, bool, bool], tuple[str, list[Any]]] = {}
        self._where_and_order: dict[bool, tuple[str, str, list[Any]]] = {}

    @property
    def connection(self) -> BaseDatabaseWrapper:
        return connections[self.alias]

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

    def columns(self, *, qualified: bool = True) -> str:
        """Every column of the model, in ``rows.fields`` order, for RETURNING or a
        read-back."""
        return self._qualified_columns if qualified else self._columns

    @cached_property
    def _columns(self) -> str:
        return ", ".join(self.quote(str(f.column)) for f in self.rows.fields)

    @cached_property
    def _qualified_columns(self) -> str:
        return ", ".join(f"{self.table}.{self.quote(str(f.column))}" for f in self.rows.fields)

    def candidates(
        self, lock: str = "", *, whole_rows: bool = False, after: tuple[Any, ...] | None = None
    ) -> tuple[str, list[Any]]:
        """``SELECT pk`` (or every column, in ``rows.fields`` order) of the first ``limit``
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

    @cached_property
    def resume_key(self) -> Callable[[Any], tuple[Any, ...]]:
        """An item's values of the claim order: where a claim after it starts."""
        if len(self.order) == 1:
            name = self.order[0]
            return lambda item: (getattr(item, name),)
        return operator.attrgetter(*self.order)

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

    def bind(
        self, values: ClaimValues, leases: list[Any], *, lock: str = "", whole_rows: bool = False
    ) -> tuple[list[Any], list[Any]]:
        """One claim's parameters: the candidates' (``candidates(lock, whole_rows)``, after
        ``values.after``) and the assignments' (``claimed_columns``, then the dialect's
        lease expiry, whose parameters ``leases`` are)."""
        _, candidates = self.candidates(lock, whole_rows=whole_rows, after=values.after)
        return candidates, self.assigned(values, leases)

    @staticmethod
    def assigned(values: ClaimValues, leases: list[Any]) -> list[Any]:
        """The parameters of ``claimed_columns`` and the lease expiry after it."""
        return [int(Status.IN_PROGRESS), values.pid, values.token, *leases]

    @cached_property
    def claimed_columns(self) -> str:
        """The SET clause, but for the lease's end: IN_PROGRESS under this claim (pid,
        token), attempt counted, claimed now; ``lease_expires_at = `` last, for the
        dialect's expiry (``Dialect.expiry_sql``)."""
        attempts = self.column("attempts")
        return (
            f"{self.column('status')} = %s, {self.column('pid')} = %s, "
            f"{self.column('claim_token')} = %s, {attempts} = {attempts} + 1, "
            f"{self.column('claimed_at')} = {now_sql(self.connection)}, "
            f"{self.column('lease_expires_at')} = "
        )

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
