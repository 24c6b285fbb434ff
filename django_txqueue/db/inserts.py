"""Enqueue's INSERT: written once per table, database and row shape, then only bound.

``Model.save()`` and ``bulk_create()`` compile their INSERT again and run every field's
conversion on each call, which costs about as much as the round trip itself. New items
of a queue differ only in their values: the statement is cached per shape (which
columns are written, and the SQL of those given as expressions, such as a delayed
``run_at``), and a value is converted by its field only when its type asks for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import cache, cached_property
from itertools import groupby
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from django.db import connections, models, transaction
from django.db.models import Model
from django.db.models.base import ModelState
from django.db.models.constants import OnConflict
from django.db.models.expressions import DatabaseDefault
from django.db.models.fields import AutoFieldMixin
from django.db.models.sql import InsertQuery

from . import dialect
from .rows import builds_plainly

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.db.models import Field

# Fields whose conversion leaves a plain int or str as it is on every vendor, so such a
# value is bound without calling the field (get_db_prep_save costs microseconds).
PLAIN_TYPES = (models.IntegerField, models.CharField, models.TextField)
PLAIN_VALUES = (int, str)  # the values such a field binds as they are

# A row's shape: the columns it writes, each with None when its value is bound, else
# the SQL of its expression or its ``Literal`` (the same shape always compiles to the
# same SQL).
Shape = tuple[tuple[str, str | None], ...]

# The types of default a single row writes into its statement's text (``Literal``):
# numbers, booleans, enumerations' members and strings.
LITERAL_TYPES = (int, str)
NO_DEFAULT = object()  # of a field without a constant default


class Literal(str):
    """A column's default, quoted by the database's schema editor as migrations quote a
    default: a single row whose value is its field's default writes it as text rather
    than binding it. A new item has about ten such columns (its status, no attempts, no
    error...); bound, they cost psycopg's quoting 9 µs of the client's CPU per enqueue.
    The text comes from the model, never from a caller's value."""


M = TypeVar("M", bound=Model)


class Inserts(Generic[M]):
    """The INSERT statements of one model on one database alias."""

    def __init__(self, model: type[M], alias: str) -> None:
        self.model = model
        self.alias = alias
        self.pk = model._meta.pk
        # Generated columns are the database's to fill; an automatic primary key too.
        self.fields = {
            field.attname: field
            for field in model._meta.concrete_fields
            if not field.generated and not (field.primary_key and field.db_returning)
        }
        # Nullable columns without a database default: leaving one out writes NULL,
        # and fewer values are quicker to send.
        self.null = {
            name
            for name, field in self.fields.items()
            if field.null and field.db_default is models.NOT_PROVIDED
        }
        # Per field: its name, itself, whether NULL may be left out, and whether a plain
        # int or str needs no conversion.
        self.columns = [
            (name, field, name in self.null, isinstance(field, PLAIN_TYPES))
            for name, field in self.fields.items()
        ]
        # A composite primary key (no column of its own) is its fields' values.
        self.auto_pk = self.pk.column is not None and self.pk.attname not in self.fields
        # The constant defaults a single row writes as text (``Literal``), by field; not
        # a text with a %, which the drivers would take for a placeholder's start.
        self.constants = {
            name: field.default
            for name, field in self.fields.items()
            if field.has_default()
            and isinstance(field.default, LITERAL_TYPES)
            and "%" not in str(field.default)
        }
        self._literals: dict[str, Literal] = {}
        self.dialect = dialect(connections[alias])
        self._statements: dict[tuple[Shape, int], tuple[str, str, str]] = {}
        self._bulk: dict[tuple[Shape, tuple[str, ...]], tuple[str, bool]] = {}
        self._types: dict[Shape, list[str]] = {}
        self._computed: dict[Shape, list[str]] = {}
        self._batch_sizes: dict[Shape, int] = {}

    @property
    def connection(self) -> BaseDatabaseWrapper:
        return connections[self.alias]

    def new(self, **values: Any) -> M:
        """``model(**values)``, unsaved; built directly (as ``Model.__init__`` would
        build it, at a fraction of its cost) when nothing could tell the difference."""
        return self.maker(**values)()

    def maker(self, **values: Any) -> Callable[..., M]:
        """What makes ``new(**values, **more)`` of each call's ``more``, with whether it
        may be built directly decided once, for a batch."""
        model = self.model
        if self.defaults is None or not builds_plainly(model):
            return lambda **more: model(**values, **more)
        base = {**self.defaults, **values}

        def make(**more: Any) -> M:
            item = object.__new__(model)
            item.__dict__ = {"_state": ModelState(), **base, **more}
            return item

        return make

    @cached_property
    def defaults(self) -> dict[str, Any] | None:
        """Each field's default as ``Model.__init__`` sets it; None if one is computed
        per instance (a callable)."""
        fields = [f for f in self.model._meta.concrete_fields if not f.generated]
        if any(callable(field.default) for field in fields if field.has_default()):
            return None
        return {field.attname: field.get_default() for field in fields}

    def add(
        self,
        values: dict[str, Any],
        payloads: Sequence[Any],
        first_round: int | None = None,
        varying: Sequence[str] | None = None,
    ) -> list[M]:
        """New rows, one per payload, of ``values`` and that ``payload`` (with
        ``first_round``, the rounds from it on, one each), inserted all or none
        (``insert``); the instances."""
        make = self.maker(**values)
        items = [make(payload=payload) for payload in payloads]
        if first_round is not None:
            for number, item in enumerate(items, start=first_round):
                item.round = number  # type: ignore[attr-defined]
        self.insert(items, varying=varying)
        return items

    def insert(self, items: Sequence[M], *, varying: Sequence[str] | None = None) -> None:
        """Insert ``items`` (unsaved instances of the model), all or none, and give each
        its primary key; what the database computes is loaded on first access.

        ``varying``: the only fields whose values differ between the items, if known (an
        ``enqueue_many``), and those values plain data, not expressions: each row is then
        the first one's with those values replaced.
        """
        connection = self.connection
        if len(items) == 1:  # an enqueue(): one row, one statement
            shape, params = self.row(connection, items[0], literals=True)
            self._insert(connection, shape, items, [params])
            return
        rows = self.rows(connection, items, varying)
        batches = list(self.batches(items, rows))
        if len(batches) == 1:
            self._insert(connection, *batches[0])
            return
        with transaction.atomic(using=self.alias, savepoint=False):
            for batch in batches:
                self._insert(connection, *batch)

    def insert_columns(self, names: Sequence[str], columns: Sequence[list[Any]]) -> None:
        """Insert the rows whose values, as bound (ints, strings), ``columns`` hold, one
        list per column of ``names``, all or none, returning nothing: rows nothing reads
        back (a flow's edges, its ``QueueFlow`` row), without a model instance, or even a
        list, built per row."""
        connection = self.connection
        shape: Shape = tuple((name, None) for name in names)
        size = self.batch_size(shape)
        with (
            transaction.atomic(using=self.alias, savepoint=False),
            self.dialect.hot_cursor(connection) as cursor,
        ):
            for start in range(0, len(columns[0]), size):
                batch = [column[start : start + size] for column in columns]
                bulk = self.bulk(connection, shape, batch) if len(batch[0]) > 1 else None
                if bulk is not None:
                    cursor.execute(bulk[0], bulk[2])
                else:
                    into, row, _ = self.parts(connection, shape, 2)
                    values = ", ".join([row] * len(batch[0]))
                    params = [v for row in zip(*batch, strict=True) for v in row]
                    cursor.execute(f"{into}VALUES {values}", params)

    def batches(
        self, items: Sequence[M], rows: list[tuple[Shape, list[Any]]]
    ) -> Iterator[tuple[Shape, Sequence[M], list[list[Any]]]]:
        """Runs of items of the same shape, each at most ``batch_size`` long, with the
        values of their rows."""
        start = 0
        for shape, run in groupby(rows, key=lambda row: row[0]):
            values = [params for _, params in run]
            size = self.batch_size(shape)
            for offset in range(0, len(values), size):
                batch = values[offset : offset + size]
                yield shape, items[start + offset : start + offset + len(batch)], batch
            start += len(values)

    def batch_size(self, shape: Shape) -> int:
        """Rows per statement of ``shape``, as many as the database's limit on bound
        values allows for the columns it writes (not every column of the model: a row
        leaves out the NULLs its columns default to)."""
        size = self._batch_sizes.get(shape)
        if size is None:
            fields = [self.fields[name] for name, _ in shape]
            size = max(1, self.connection.ops.bulk_batch_size(fields, [None] * 10_000))
            self._batch_sizes[shape] = size
        return size

    def rows(
        self, connection: BaseDatabaseWrapper, items: Sequence[M], varying: Sequence[str] | None
    ) -> list[tuple[Shape, list[Any]]]:
        """Each item's ``row``; of items differing only in ``varying``, made from the
        first's, converting only those values (a row's own pass costs microseconds)."""
        first = self.row(connection, items[0])
        shape, params = first
        positions = None if varying is None else self.positions(shape, varying)
        if positions is None:
            return [first, *(self.row(connection, item) for item in items[1:])]
        rows = [first]
        for item in items[1:]:
            values = item.__dict__
            row = params.copy()
            for position, name, field, plain in positions:
                value = values[name]
                row[position] = (
                    None if value is None else self.bind(field, plain, value, connection)
                )
            rows.append((shape, row))
        return rows

    def positions(
        self, shape: Shape, names: Sequence[str]
    ) -> list[tuple[int, str, Field[Any, Any], bool]] | None:
        """Where in a row of ``shape`` each of ``names`` is bound, with its field and
        whether a plain int or str needs no conversion. None, for rows made one by one,
        where one is left out (NULL) or a column is an expression (whose parameters
        shift the positions)."""
        bound = {name: position for position, (name, expression) in enumerate(shape)}
        if any(expression is not None for _, expression in shape) or not set(names) <= set(bound):
            return None
        return [
            (bound[name], name, self.fields[name], isinstance(self.fields[name], PLAIN_TYPES))
            for name in names
        ]

    def row(
        self, connection: BaseDatabaseWrapper, item: Model, *, literals: bool = False
    ) -> tuple[Shape, list[Any]]:
        """The shape of ``item``'s row and the values it binds, in one pass; with
        ``literals``, its fields' defaults as text (``Literal``), not bound. (Rows of
        many items send what they share once, as a bulk source: not as literals.)"""
        values = item.__dict__
        constants = self.constants if literals else {}
        shape: list[tuple[str, str | None]] = []
        params: list[Any] = []
        for name, field, nullable, plain in self.columns:
            value = values.get(name)
            default = constants.get(name, NO_DEFAULT)
            if type(value) is type(default) and value == default:
                shape.append((name, self.literal(connection, name)))
            elif value is None:
                if nullable:
                    continue  # left out: NULL is the column's default
                shape.append((name, None))
                params.append(None)
            elif plain and type(value) in PLAIN_VALUES:  # as the field would leave it
                shape.append((name, None))
                params.append(value)
            elif not hasattr(value, "resolve_expression"):
                shape.append((name, None))
                params.append(field.get_db_prep_save(value, connection))
            elif not isinstance(value, DatabaseDefault):  # else left to the db_default
                sql, expression_params = self.expression_sql(field, value)
                shape.append((name, sql))
                params += expression_params
        return tuple(shape), params

    def literal(self, connection: BaseDatabaseWrapper, name: str) -> Literal:
        """Field ``name``'s constant default as its statement's text (``Literal``)."""
        literal = self._literals.get(name)
        if literal is None:
            field = self.fields[name]
            value = field.get_prep_value(self.constants[name])  # a plain int, bool or str
            literal = Literal(connection.schema_editor().quote_value(value))
            self._literals[name] = literal
        return literal

    @staticmethod
    def bind(
        field: Field[Any, Any], plain: bool, value: Any, connection: BaseDatabaseWrapper
    ) -> Any:
        """``value`` as its column binds it: a plain int or str as it is where ``plain``
        (the field would leave it so), anything else converted by the field."""
        if plain and type(value) in PLAIN_VALUES:
            return value
        return field.get_db_prep_save(value, connection)

    def _insert(
        self,
        connection: BaseDatabaseWrapper,
        shape: Shape,
        items: Sequence[M],
        rows: list[list[Any]],
    ) -> None:
        bulk = None
        if len(items) > 1 and self.dialect.bulk_source:
            bulk = self.bulk(connection, shape, list(zip(*rows, strict=True)))
        if bulk is not None:  # a few parameters for all the rows
            sql, returning, params = bulk
        else:
            sql, returning = self.statement(connection, shape, len(items))
            params = [value for row in rows for value in row]
        with self.dialect.hot_cursor(connection) as cursor:
            cursor.execute(sql, params)
            if returning:
                pks = [row[0] for row in cursor.fetchall()]
                if isinstance(self.pk, AutoFieldMixin):
                    # A sequence or auto-increment numbers one statement's rows in the
                    # order they were inserted, whatever order RETURNING gives them in.
                    pks.sort()
            elif self.auto_pk and len(items) == 1:  # MySQL: no RETURNING, only one row's id
                pks = [connection.ops.last_insert_id(cursor, "", "")]
            else:
                pks = []  # as bulk_create there: no primary keys
        pk = self.pk.attname
        computed = self.computed(shape)
        for item, value in zip(items, pks, strict=False):
            item.__dict__[pk] = value
        for item in items:
            item._state.adding, item._state.db = False, self.alias
            for name in computed:  # loaded on first access, if ever
                item.__dict__.pop(name, None)

    def expression_sql(self, field: Field[Any, Any], value: Any) -> tuple[str, list[Any]]:
        compiler = InsertQuery(self.model).get_compiler(connection=self.connection)
        resolved = value.resolve_expression(compiler.query, allow_joins=False, for_save=True)
        sql, params = compiler.compile(resolved)
        return sql, list(params)

    def computed(self, shape: Shape) -> list[str]:
        """The fields the database computes for a row of ``shape``: those given as an
        expression or left to their db_default, and the generated ones (not a
        ``Literal``: the instance holds that value). Reading their values back would cost
        more (per value, a conversion) than the rare query that loads them when read."""
        if shape not in self._computed:
            written = dict(shape)
            self._computed[shape] = [
                field.attname
                for field in self.model._meta.concrete_fields
                if not field.primary_key
                and written.get(field.attname, "") is not None
                and not isinstance(written.get(field.attname), Literal)
                and not (field.attname in self.null and field.attname not in written)
            ]
        return self._computed[shape]

    def bulk(
        self, connection: BaseDatabaseWrapper, shape: Shape, columns: Sequence[Sequence[Any]]
    ) -> tuple[str, bool, list[Any]] | None:
        """The INSERT of the rows of ``shape`` whose values ``columns`` hold (a sequence
        per column) from the database's bulk source
        (``Dialect.bulk_layout``), whether it returns their primary keys, and its
        parameters; None where it has none, a column is an expression, or the source
        cannot carry these values (they go as VALUES)."""
        if not self.dialect.bulk_source or any(sql is not None for _, sql in shape):
            return None
        types = self.types(connection, shape)
        layout = self.dialect.bulk_layout(connection, types, columns)
        if layout is None:
            return None
        try:
            params = self.dialect.bulk_params(columns, layout)
        except TypeError:  # a value JSON cannot carry (bytes, say)
            return None
        key = (shape, layout)
        if key not in self._bulk:  # one per shape and way its columns are sent
            into, _, returning = self.parts(connection, shape, 2)
            source = self.dialect.bulk_rows(connection, types, layout)
            self._bulk[key] = (into + source + returning, bool(returning))
        return *self._bulk[key], params

    def types(self, connection: BaseDatabaseWrapper, shape: Shape) -> list[str]:
        """The database types of the columns of ``shape``, cached per shape."""
        if shape not in self._types:
            self._types[shape] = [self.fields[name].db_type(connection) or "" for name, _ in shape]
        return self._types[shape]

    def statement(
        self, connection: BaseDatabaseWrapper, shape: Shape, rows: int
    ) -> tuple[str, bool]:
        """The INSERT of ``rows`` rows of ``shape`` as VALUES, and whether it returns the
        automatic primary keys (not where the database cannot)."""
        into, row, returning = self.parts(connection, shape, rows)
        if rows <= 1:
            return f"{into}VALUES {row}{returning}", bool(returning)
        # Not cached: one text per batch size would pile up in a long-lived process.
        return f"{into}VALUES {', '.join([row] * rows)}{returning}", bool(returning)

    def parts(
        self, connection: BaseDatabaseWrapper, shape: Shape, rows: int
    ) -> tuple[str, str, str]:
        """The statement's ``INSERT INTO table (columns)``, one VALUES row and its
        RETURNING clause (or ""), cached per shape."""
        key = (shape, min(rows, 2))  # a single row and many rows differ in RETURNING
        if key not in self._statements:
            quote = connection.ops.quote_name
            fields = [self.fields[name] for name, _ in shape]
            columns = ", ".join(quote(str(field.column)) for field in fields)
            table = quote(self.model._meta.db_table)
            into = f"INSERT INTO {table} ({columns}) "
            row = "(" + ", ".join(expression or "%s" for _, expression in shape) + ")"
            features = connection.features
            returns = self.auto_pk and (
                features.can_return_columns_from_insert
                if rows == 1
                else features.can_return_rows_from_bulk_insert
            )
            returning = f" RETURNING {quote(str(self.pk.column))}" if returns else ""
            self._statements[key] = (into, row, returning)
        return self._statements[key]


@cache
def inserts(model: type[M], alias: str) -> Inserts[M]:
    """The ``Inserts`` of ``model`` on database ``alias``, made on first use."""
    return Inserts(model, alias)


def insert_or_ignore(instance: Model, fields: Sequence[str], alias: str) -> bool:
    """INSERT ``instance``'s ``fields`` (the others take their column defaults) unless a
    unique constraint already holds the row; True if this statement inserted it.

    Django compiles each vendor's spelling (ON CONFLICT DO NOTHING, INSERT IGNORE, INSERT
    OR IGNORE), as ``bulk_create(ignore_conflicts=True)`` would, but that hides the row
    count, which is what tells whether this statement won. A conflict ignored raises
    nothing, so no server logs an error for it either. MySQL's IGNORE also makes other
    errors (a value too long) warnings: callers insert values checked beforehand.
    """
    model = type(instance)
    query = InsertQuery(model, on_conflict=OnConflict.IGNORE)
    columns = [field for field in model._meta.concrete_fields if field.name in fields]
    query.insert_values(columns, [instance])
    [(sql, params)] = query.get_compiler(using=alias).as_sql()
    with connections[alias].cursor() as cursor:
        cursor.execute(sql, params)
        return int(cursor.rowcount) == 1
