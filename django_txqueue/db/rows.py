"""Claimed rows made into model instances, and the column facts every statement needs.

A claim returns whole rows in ``fields`` order; ``Rows.load`` converts each column as
Django would and builds the instance directly where nothing could tell that from
``Model.from_db`` (which costs a ``setattr`` per field and two signals per row).
"""

from __future__ import annotations

import operator
from functools import cache, cached_property
from typing import TYPE_CHECKING, Any

from django.db import connections
from django.db.models import Model
from django.db.models.base import ModelState
from django.db.models.functions import Now
from django.db.models.signals import post_init, pre_init
from django.db.models.sql.subqueries import UpdateQuery

from ..status import Status

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper


def quoted_column(connection: BaseDatabaseWrapper, model: type[Any], name: str) -> str:
    """A field's column (``"pk"`` for the primary key), quoted for ``connection``."""
    field = model._meta.pk if name == "pk" else model._meta.get_field(name)
    return connection.ops.quote_name(str(field.column))


def has_field(model: type[Any], name: str) -> bool:
    """Whether ``model`` has a concrete field ``name`` (a plain QueueModel lacks QueueItem's
    queue, result, last_error...)."""
    return any(field.name == name for field in model._meta.concrete_fields)


_now_sql: dict[str, str] = {}


def now_sql(connection: BaseDatabaseWrapper) -> str:
    """The database clock as SQL, as Django's ``Now()`` writes it for this vendor."""
    if connection.vendor not in _now_sql:
        compiler = UpdateQuery(None).get_compiler(connection=connection)
        sql, params = compiler.compile(Now())
        assert not params  # noqa: S101 - Now() takes none
        _now_sql[connection.vendor] = sql
    return _now_sql[connection.vendor]


class Rows:
    """Instances of ``model`` from rows of all its concrete columns, read on ``alias``, in
    ``order`` (field names, ``-`` for descending: a claim's order)."""

    def __init__(self, model: type[Model], alias: str, order: tuple[Any, ...] = ()) -> None:
        self.model = model
        self.alias = alias
        self.order = order
        self.fields: list[Any] = list(model._meta.concrete_fields)
        self._converters: dict[int, list[tuple[int, list[Any], bool]]] = {}

    def load(self, rows: list[Any], *, claimed_by: tuple[str, int] | None = None) -> list[Any]:
        """Instances of ``rows`` in ``order`` (RETURNING gives none): each column converted
        as Django converts it, then the instance built directly when nothing could tell,
        else through ``from_db``. ``claimed_by``: rows read before their claiming UPDATE,
        given the values it wrote (``mark_claimed``)."""
        connection = connections[self.alias]
        converters = self.converters(connection)
        fields = self.fields
        build = self.build if builds_plainly(self.model) else self.from_db
        items = []
        for row in rows:
            values = list(row)
            for index, functions, keeps_none in converters:
                if values[index] is None and keeps_none:
                    continue
                for convert in functions:
                    values[index] = convert(values[index], fields[index], connection)
            items.append(build(values))
        if claimed_by is not None:
            mark_claimed(items, *claimed_by)
        return sort_items(items, self.order)

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


def sort_items(items: list[Any], order: tuple[Any, ...]) -> list[Any]:
    """Put rows in ``order``, where it names fields only."""
    if not all(isinstance(name, str) for name in order):
        return items
    for name in reversed(order):
        items.sort(key=operator.attrgetter(name.lstrip("-")), reverse=name.startswith("-"))
    return items


def mark_claimed(items: list[Any], pid: str, token: int) -> list[Any]:
    """Give rows read before their claiming UPDATE the values it wrote.

    The times it set by the database clock are left deferred: loaded on first access.
    """
    for item in items:
        # A plain int, as a row read back holds, not the Status member.
        item.status, item.pid, item.claim_token = int(Status.IN_PROGRESS), pid, token
        item.attempts += 1
        item.__dict__.pop("claimed_at", None)
        item.__dict__.pop("lease_expires_at", None)
    return items


def builds_plainly(model: type[Model]) -> bool:
    """Whether ``Model.from_db`` and ``model(**values)`` come to storing each value in
    ``__dict__``, so that an instance may be built that way directly: no receiver of
    ``pre_init`` / ``post_init`` for the model (asked each time, as they may connect
    later), and, fixed per model, no ``from_db`` or ``__init__`` of its own and no field
    that intercepts assignment."""
    return _plain_model(model) and not any(
        signal.receivers and signal.has_listeners(model) for signal in (pre_init, post_init)
    )


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
