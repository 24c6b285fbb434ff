"""An acknowledgement as one value, ``Ack``, and its statement, ``AckStatement``, beside
``compiler.ClaimStatement``: what a settled batch must write, and the one fenced UPDATE
that writes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, cached_property
from typing import TYPE_CHECKING, Any

from django.db import connections
from django.db.models.sql import Query

from ..status import Status, settled_as
from . import dialect
from .rows import has_field, now_sql, quoted_column

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.db.models import Model


@dataclass(frozen=True)
class Ack:
    """The successes of one claim: its fencing token and ``{pk: result}``. Only rows still
    IN_PROGRESS under that token are acknowledged."""

    claim_token: int
    results: dict[Any, Any]


class AckStatement:
    """The fenced acknowledgement of ``model``'s items on database ``alias``: DONE (or
    CANCELLED where a cancellation was requested, ``status.settled_as``), the results where
    the model keeps them, in one UPDATE per claim. Its SQL is built once per batch size
    and shape (``Dialect.ack_update``); ``bind`` gives it an ``Ack``'s parameters."""

    def __init__(self, model: type[Model], alias: str) -> None:
        self.model = model
        self.alias = alias
        self.keeps_results = has_field(model, "result")
        # Rows something waits for are not acknowledged here (``store.flows``).
        self.in_flows = has_field(model, "has_dependents")
        self._sql: dict[tuple[int, bool], str] = {}

    @property
    def connection(self) -> BaseDatabaseWrapper:
        return connections[self.alias]

    def bind(self, ack: Ack, pk_params: list[Any]) -> tuple[str, list[Any]]:
        """The UPDATE acknowledging ``ack`` and its parameters, the dialect's ``pk_params``
        of its items given."""
        with_results = self.keeps_results and any(v is not None for v in ack.results.values())
        sql = self.sql(len(ack.results), with_results)
        params = list(self.status[1])
        if with_results:
            connection = self.connection
            field: Any = self.model._meta.get_field("result")
            for pk, value in ack.results.items():
                params += [pk, field.get_db_prep_save(value, connection)]
        # Plain ints: mysqlclient would quote a Status member as a string.
        params += [*pk_params, int(Status.IN_PROGRESS), ack.claim_token]
        return sql, [*params, False] if self.in_flows else params

    def sql(self, size: int, with_results: bool) -> str:
        key = (size, with_results)
        if key not in self._sql:
            connection = self.connection
            names = ["pk", "status", "lease_expires_at", "claim_token"]
            if self.keeps_results:
                names += ["result", "finished_at"]
            if self.in_flows:
                names.append("has_dependents")
            columns = {name: quoted_column(connection, self.model, name) for name in names}
            table = connection.ops.quote_name(self.model._meta.db_table)
            self._sql[key] = dialect(connection).ack_update(
                table, columns, self.status[0], now_sql(connection), size, with_results
            )
        return self._sql[key]

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
