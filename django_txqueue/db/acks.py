"""An acknowledgement as one value, ``Ack``, and its statement, ``AckStatement``, beside
``compiler.ClaimStatement``: what a settled batch must write, and the one fenced UPDATE
that writes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, cached_property
from typing import TYPE_CHECKING, Any

from django.apps import apps
from django.db import connections
from django.db.models.sql import Query

from ..status import Status, settled_as
from . import dialect
from .rows import has_field, now_sql, quoted_column

if TYPE_CHECKING:
    from collections.abc import Iterable

    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.db.models import Model


@dataclass(frozen=True)
class Ack:
    """The successes of one claim: its fencing token and ``{pk: result}``. Only rows still
    IN_PROGRESS under that token are acknowledged.

    ``dependents``, where one of them was claimed waited for: each item's
    ``dependent_count`` as its claim read it (``claimed_dependents``). The
    acknowledgement then counts down what waits for them, in its own transaction, and
    takes only the rows whose count has not changed since: for those, it knows every
    edge (``Dialect.ack_on``)."""

    claim_token: int
    results: dict[Any, Any]
    dependents: dict[Any, int] | None = None


def claimed_dependents(items: Iterable[Model]) -> dict[Any, int] | None:
    """``Ack.dependents`` of one claim's ``items``, as their claim read them (no query);
    None where nothing waits for any of them, or the model has no flows."""
    counts = {item.pk: item.__dict__.get("dependent_count", 0) for item in items}
    return counts if any(counts.values()) else None


class AckStatement:
    """The fenced acknowledgement of ``model``'s items on database ``alias``: DONE (or
    CANCELLED where a cancellation was requested, ``status.settled_as``), the results where
    the model keeps them, in one UPDATE per claim. Its SQL is built once per batch size
    and shape (``Dialect.ack_update``); ``bind`` gives it an ``Ack``'s parameters."""

    def __init__(self, model: type[Model], alias: str) -> None:
        self.model = model
        self.alias = alias
        self.keeps_results = has_field(model, "result")
        # Rows something waits for are left to ``store.flows``, but those a counting
        # acknowledgement takes (``Ack.dependents``).
        self.in_flows = has_field(model, "dependent_count")
        self._sql: dict[tuple[int, bool, bool, bool], str] = {}
        self._count_down: dict[int, str] = {}

    @property
    def connection(self) -> BaseDatabaseWrapper:
        return connections[self.alias]

    def bind(self, ack: Ack, pk_params: list[Any]) -> tuple[str, list[Any]]:
        """The UPDATE acknowledging ``ack`` and its parameters, the dialect's ``pk_params``
        of its items given."""
        with_results = self.keeps_results and any(v is not None for v in ack.results.values())
        dependents = ack.dependents if self.in_flows and ack.dependents else None
        # One count bound where the claim read the same on every row: a group's steps.
        one_count = dependents is not None and len(set(dependents.values())) == 1
        sql = self.sql(len(ack.results), with_results, dependents is not None, one_count)
        params = list(self.status[1])
        if with_results:
            connection = self.connection
            field: Any = self.model._meta.get_field("result")
            for pk, value in ack.results.items():
                params += [pk, field.get_db_prep_save(value, connection)]
        # Plain ints: mysqlclient would quote a Status member as a string.
        params += [*pk_params, int(Status.IN_PROGRESS), ack.claim_token]
        if dependents is not None and one_count:
            params.append(next(iter(dependents.values())))
        elif dependents is not None:
            for pk, count in dependents.items():
                params += [pk, count]
        return sql, params

    def sql(
        self, size: int, with_results: bool, counting: bool = False, one_count: bool = False
    ) -> str:
        key = (size, with_results, counting, one_count)
        if key not in self._sql:
            connection = self.connection
            names = ["pk", "status", "lease_expires_at", "claim_token"]
            if self.keeps_results:
                names += ["result", "finished_at"]
            if self.in_flows:
                names += ["dependent_count", "cancel_requested_at"]
            columns = {name: quoted_column(connection, self.model, name) for name in names}
            table = connection.ops.quote_name(self.model._meta.db_table)
            self._sql[key] = dialect(connection).ack_update(
                table,
                columns,
                self.status[0],
                now_sql(connection),
                size,
                with_results,
                counting,
                one_count,
            )
        return self._sql[key]

    def count_down(self, pk_params: list[Any], size: int) -> tuple[str, list[Any]]:
        """The UPDATE that counts down, once per edge, the WAITING items that wait for the
        ``size`` items just acknowledged DONE (the dialect's ``pk_params`` of them),
        READY at zero, and its parameters (``Dialect.count_down_update``: on PostgreSQL,
        CTEs that follow the acknowledgement's in its statement)."""
        if size not in self._count_down:
            connection = self.connection
            edge = apps.get_model(self.model._meta.app_label, "QueueDependency")
            names = ["pk", "status", "waiting_for", "queue"]
            columns = {name: quoted_column(connection, self.model, name) for name in names}
            columns["edge_item"] = quoted_column(connection, edge, "item")
            columns["edge_parent"] = quoted_column(connection, edge, "parent")
            quote = connection.ops.quote_name
            self._count_down[size] = dialect(connection).count_down_update(
                quote(self.model._meta.db_table), quote(edge._meta.db_table), columns, size
            )
        return self._count_down[size], dialect(self.connection).count_down_params(pk_params)

    @cached_property
    def pk_column(self) -> str:
        return quoted_column(self.connection, self.model, "pk")

    @cached_property
    def status(self) -> tuple[str, list[Any]]:
        """The new status's SQL and parameters, compiled once from ``settled_as(DONE)`` by
        Django; plain DONE for a model without cancellation requests (a plain QueueModel)."""
        if not has_field(self.model, "cancel_requested_at"):
            return "%s", [int(Status.DONE)]
        query = Query(self.model)
        expression = settled_as(Status.DONE).resolve_expression(query, allow_joins=False)
        sql, params = query.get_compiler(connection=self.connection).compile(expression)
        return sql, list(params)


@cache
def ack_statement(model: type[Model], alias: str) -> AckStatement:
    """The acknowledgement statement of ``model``'s items on ``alias``, made once."""
    return AckStatement(model, alias)
