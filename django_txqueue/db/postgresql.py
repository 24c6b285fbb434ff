"""PostgreSQL: claims as single statements, LISTEN/NOTIFY wake-ups, planner estimates."""

from __future__ import annotations

import hashlib
import json
import secrets
import select
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from functools import cache
from typing import TYPE_CHECKING, Any

from django.db import (
    DatabaseError,
    Error,
    InterfaceError,
    OperationalError,
    connections,
    transaction,
)

from ..status import Status
from .base import SHARED, Dialect, NotificationsLost, shared_columns

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.db.models import QuerySet

    from .acks import Ack, AckStatement
    from .compiler import ClaimStatement, ClaimValues

# How often an update_limit claim that lost all its rows to concurrent claims tries again.
LOST_RACE_RETRIES = 5
# How ``bulk_rows`` carries a column that varies: an array, or a JSON column's values as
# one JSON array (``json_array``).
ARRAY, JSON = "array", "json"
# serialization_failure, deadlock_detected
TRANSIENT_SQLSTATES = {"40001", "40P01"}
# The channel the items table's trigger (migration 0002) NOTIFYs at commit, with the
# queue name as payload.
CHANNEL = "django_txqueue"
# Lost connections: connection_exception (class 08), and admin_shutdown, crash_shutdown,
# cannot_connect_now, read_only_sql_transaction (a former primary that came back as a
# standby, or a standby reached without target_session_attrs=read-write).
DISCONNECT_CLASS = "08"
DISCONNECT_SQLSTATES = {"57P01", "57P02", "57P03", "25006"}
# How long a new listener waits for its probe notification before it concludes that
# notifications do not reach it (a transaction pool between it and the server).
PROBE_TIMEOUT = 2.0
# Where ``hot_cursor`` keeps its psycopg cursor on Django's connection wrapper (one per
# thread), beside the psycopg connection it belongs to: a new connection gets a new one.
KEPT_CURSOR = "_txqueue_kept_cursor"


class PostgreSQL(Dialect):
    vendor = "postgresql"
    has_notify = True
    bulk_source = True
    acks_while_claiming = frozenset({"skip_locked"})
    resumes_claims = True

    def claim_skip_locked(self, claim: ClaimStatement, values: ClaimValues) -> list[Any]:
        """Lock the first ready rows nobody else holds and claim them, in one round trip."""
        return self.fetch(claim, *self._claim_statement(claim, values, "FOR UPDATE SKIP LOCKED"))

    def claim_update_limit(self, claim: ClaimStatement, values: ClaimValues) -> list[Any]:
        """Claim the first n ready rows, waiting on locked ones.

        PostgreSQL has no UPDATE ... LIMIT; a locking, materialised sub-SELECT with LIMIT
        is its equivalent (unmaterialised, the planner may re-run it and claim more than
        n). A row another transaction holds is waited for and re-checked, and dropped if
        it stopped being READY meanwhile. Unlike InnoDB, PostgreSQL does not then read on
        past it, so a claim that lost every row to a concurrent one is run again while
        ready rows remain.
        """
        sql, params = self._claim_statement(claim, values, "FOR UPDATE")
        for _ in range(LOST_RACE_RETRIES):
            items = self.fetch(claim, sql, params)
            if items or not claim.queryset.exists():
                return items
        return []

    def ack_and_claim(
        self, claim: ClaimStatement, values: ClaimValues, statement: AckStatement, ack: Ack
    ) -> tuple[int, list[Any]]:
        """The acknowledgement ``ack`` and a skip_locked claim in one statement: one round
        trip per batch instead of two. Both run whatever the other finds (a data-modifying
        CTE always runs to completion); they touch different rows (held IN_PROGRESS by
        the acknowledging claim; READY), so neither waits for the other. The single row
        joined to the claimed ones carries the acknowledged count when none is claimed.
        One that counts down does it in the same statement (``acknowledged``); the claim
        reads the rows as they were before it, so where it released some and claimed
        nothing, a second claim looks again.

        A claim that reads other rows (an ordered queue's running items) runs after the
        acknowledgement instead: in one statement it would see them as they were before
        it (one snapshot) and hold their keys back."""
        if claim.reads_other_rows:
            return self.acknowledge(statement, ack), self.claim_skip_locked(claim, values)
        ctes, ack_params = self.acknowledged(statement, ack)
        claim_sql, claim_params = self._claim_statement(claim, values, "FOR UPDATE SKIP LOCKED")
        sql = (
            f"WITH {ctes}, claimed AS ({claim_sql}) "
            f"SELECT (SELECT count(*) FROM acked), {self.released_count(ack)}, claimed.* "
            "FROM (SELECT 1) AS one LEFT JOIN claimed ON true"
        )
        with self.hot_cursor(connections[claim.alias]) as cursor:
            cursor.execute(sql, ack_params + claim_params)
            rows = cursor.fetchall()
        claimed = claim.rows.load([row[2:] for row in rows if row[2] is not None])  # pk
        if rows[0][1] and not claimed:
            claimed = self.claim_skip_locked(claim, values)
        return int(rows[0][0]), claimed

    def acknowledge(self, statement: AckStatement, ack: Ack) -> int:
        if not ack.dependents:
            return super().acknowledge(statement, ack)
        ctes, params = self.acknowledged(statement, ack)
        sql = f"WITH {ctes} SELECT (SELECT count(*) FROM acked), {self.released_count(ack)}"
        with self.hot_cursor(connections[statement.alias]) as cursor:
            cursor.execute(sql, params)
            return int(cursor.fetchone()[0])

    def acknowledged(self, statement: AckStatement, ack: Ack) -> tuple[str, list[Any]]:
        """The CTEs that acknowledge ``ack`` (``acked``, the rows it took) and, where it
        counts down, count down what waits for them (``counted``) and NOTIFY the queues of
        those it made READY (``told``), with their parameters.

        One statement is safe here: the acknowledgement takes only rows whose
        ``dependent_count`` is as their claim read it, and a producer adding an edge to a
        row changes it. A row it waited for a producer to release is then read again
        with that change (and left to ``store.flows``), where the count-down, reading the
        edges as they were when the statement began, would miss the new one."""
        pks = self.pk_params(list(ack.results))
        ack_sql, params = statement.bind(ack, pks)
        ctes = f"acked AS ({ack_sql} RETURNING {statement.pk_column})"
        if not ack.dependents:
            return ctes, params
        count_down, count_params = statement.count_down(pks, len(ack.results))
        return f"{ctes}, {count_down}", params + count_params

    @staticmethod
    def released_count(ack: Ack) -> str:
        """How many items the statement released (``acknowledged``), 0 where it counts
        nothing down."""
        return "(SELECT count(*) FROM told)" if ack.dependents else "0"

    @contextmanager
    def hot_cursor(self, connection: BaseDatabaseWrapper) -> Iterator[Any]:
        """A cursor for the claims, acknowledgements and inserts: Django's wrapper (its
        errors, its query log, its ``execute_wrapper``s) around one psycopg cursor kept
        per connection (``kept_cursor``) and not closed after use. A new psycopg cursor
        per statement cost 30-60 µs of the client's CPU (of about 60 for an enqueue's
        INSERT itself): each one looks up again the adapter of every parameter's type
        and every column it reads, which a kept cursor has looked up once."""
        wrapper: Any = connection  # _prepare_cursor: Django's own step of cursor()
        if wrapper.allow_thread_sharing:
            # Shared between threads (inc_thread_sharing): a cursor is not, so each
            # statement gets one of its own, as from Django's cursor().
            with super().hot_cursor(connection) as cursor:
                yield cursor
            return
        wrapper.close_if_health_check_failed()
        wrapper.ensure_connection()
        kept = getattr(wrapper, KEPT_CURSOR, None)
        if kept is None or kept[0] is not wrapper.connection:
            with wrapper.wrap_database_errors:
                kept = (wrapper.connection, self.kept_cursor(wrapper))
            setattr(wrapper, KEPT_CURSOR, kept)
        yield wrapper._prepare_cursor(kept[1])

    def kept_cursor(self, connection: Any) -> Any:
        """``hot_cursor``'s psycopg cursor: Django's own, or, where the connection
        prepares statements (``OPTIONS``' ``prepare_threshold``; Django's default, None,
        prepares none, as a transaction pool needs), one that binds on the server, so
        that the server plans each claim, acknowledgement and INSERT shape once (an
        enqueue's INSERT then costs the server about a third less). Django's cursor binds
        on the client, which nothing prepares; unprepared, server-side binding saved no
        client time and cost the server 4% more (docs/benchmarks.md).

        A claimed row holds four timestamps. Django reads each through a loader of its
        own that replaces the value's tzinfo with the connection's, in Python: 1 µs per
        value. Where psycopg's C loader gives that same tzinfo object (the session's
        time zone is Django's: UTC, with ``USE_TZ``), the cursor reads them with it."""
        if connection.connection.prepare_threshold is None:
            cursor = connection.create_cursor()
        else:
            from django.db.backends.postgresql.base import ServerBindingCursor

            server_binding: Any = ServerBindingCursor  # psycopg's class; stubs lack it
            cursor = server_binding(connection.connection)
        if connection.connection.info.timezone is connection.timezone:
            cursor.adapters.register_loader(*timestamptz_loader())
        return cursor

    @contextmanager
    def try_lock(self, connection: BaseDatabaseWrapper, name: str) -> Iterator[bool]:
        """A transaction-level advisory lock (per database), keyed by a hash of ``name``:
        the work under it runs in the one transaction that holds it, and the lock ends
        with that transaction whatever happens. A session lock would be taken on one
        server connection and released on another behind a transaction pool (PgBouncer),
        and leak."""
        key = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)
        with transaction.atomic(using=connection.alias):
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_try_advisory_xact_lock(%s)", [key])
                taken = bool(cursor.fetchone()[0])
            yield taken

    def count_down_update(self, items: str, edges: str, columns: dict[str, str], size: int) -> str:
        """The CTEs after ``acked`` (``acknowledged``): each WAITING item with edges to the
        rows acknowledged counts down by their number, READY at zero (``counted``), and the
        queues of those made READY are told (``told``; the server delivers a channel's
        same payload once per transaction, however often it was sent). Parameters:
        ``count_down_params``."""
        pk, status, waiting = columns["pk"], columns["status"], columns["waiting_for"]
        item, parent = columns["edge_item"], columns["edge_parent"]
        # Each acknowledged row's edges are read by its own key, a lookup of the edges'
        # index however large the batch and whatever the statistics say. Joined to
        # ``acked`` (of unknown size) the planner read every edge, or checked each edge
        # against every row acknowledged (a batch of 100: 1.2 ms of a 3.4 ms statement);
        # by an ARRAY of its keys, where the tables had no statistics yet, every item.
        # The items counted down are then found by primary key: their WAITING check
        # reads ``status + 0``, which the WAITING index's predicate cannot match (the
        # planner read every WAITING item through it, and the dead ones a drain leaves).
        edges_to_acked = (
            f"SELECT d.item, count(*) AS n FROM acked AS a, unnest(ARRAY("
            f"SELECT e.{item} FROM {edges} AS e WHERE e.{parent} = a.{pk})) AS d (item) "
            "GROUP BY d.item"
        )
        return (
            f"counted AS (UPDATE {items} SET {status} = CASE WHEN {items}.{waiting} <= c.n "
            f"THEN %s ELSE {items}.{status} END, {waiting} = {items}.{waiting} - c.n "
            f"FROM ({edges_to_acked}) AS c WHERE {items}.{pk} = c.item "
            f"AND {items}.{status} + 0 = %s "
            f"RETURNING {items}.{status}, {items}.{columns['queue']}), "
            f"told AS (SELECT pg_notify(%s, {columns['queue']}) FROM counted WHERE {status} = %s)"
        )

    def count_down_params(self, pk_params: list[Any]) -> list[Any]:
        ready = int(Status.READY)
        return [ready, int(Status.WAITING), CHANNEL, ready]

    def announce(self, connection: BaseDatabaseWrapper, queue: str) -> None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_notify(%s, %s)", [CHANNEL, queue])

    def _claim_statement(
        self, claim: ClaimStatement, values: ClaimValues, lock: str
    ) -> tuple[str, list[Any]]:
        """Lock the candidates with ``lock`` and claim those still READY, returning them.

        The rows are found again by primary key. Their READY check reads ``status + 0``,
        which the READY partial index's predicate cannot match: with statistics taken
        while the table was empty (autovacuum off, or not yet run), the planner looked
        each id up in that index, a scan of all of it per row."""
        candidate_params, assignment_params = claim.bind(values, self.leases(values), lock=lock)
        key = self.shape(values, lock)
        if key not in claim.sql:
            candidates, _ = claim.candidates(lock, after=values.after)
            claim.sql[key] = (
                f"WITH picked ({claim.pk}) AS MATERIALIZED ({candidates}) "
                f"UPDATE {claim.table} SET {self.assignments_sql(claim, values)} FROM picked "
                f"WHERE {claim.table}.{claim.pk} = picked.{claim.pk} "
                f"AND {claim.table}.{claim.column('status')} + 0 = %s "
                f"RETURNING {claim.columns()}"
            )
        return claim.sql[key], candidate_params + assignment_params + [int(Status.READY)]

    def bulk_layout(
        self, connection: BaseDatabaseWrapper, types: list[str], columns: Sequence[Sequence[Any]]
    ) -> tuple[str, ...]:
        """A column that varies as an array, a JSON one (the payloads) as one JSON array
        where its values allow: psycopg dumps an array of jsonb value by value, about
        18 us each, and one ``json.dumps`` of them all costs a thirtieth of that."""
        return tuple(
            SHARED if shared else JSON if column_type == "jsonb" and json_array(column) else ARRAY
            for column_type, column, shared in zip(
                types, columns, shared_columns(columns), strict=True
            )
        )

    def bulk_rows(
        self, connection: BaseDatabaseWrapper, types: list[str], layout: tuple[str, ...]
    ) -> str:
        """The rows from ``ROWS FROM`` (``unnest`` of an array, ``jsonb_array_elements``
        of a JSON array), the shared values one parameter each: a few parameters for a
        thousand rows, which psycopg and the planner handle far faster than thousands.
        Sizes are dropped (varchar[], not varchar(100)[]): a cast would cut a long value
        where the column refuses it."""
        selected: list[str] = []
        sources: list[str] = []
        for column_type, form in zip(types, layout, strict=True):
            base = column_type.split("(")[0]
            if form == SHARED:
                selected.append(f"%s::{base}")
                continue
            selected.append(f"c{len(sources)}")
            sources.append(
                "jsonb_array_elements(%s::jsonb)" if form == JSON else f"unnest(%s::{base}[])"
            )
        names = ", ".join(f"c{n}" for n in range(len(sources)))
        return (
            f"SELECT {', '.join(selected)} FROM ROWS FROM ({', '.join(sources)}) AS bulk ({names})"
        )

    def bulk_params(self, columns: Sequence[Sequence[Any]], layout: tuple[str, ...]) -> list[Any]:
        values = [
            column[0] for column, form in zip(columns, layout, strict=True) if form == SHARED
        ]
        for column, form in zip(columns, layout, strict=True):
            if form == JSON:
                values.append(column[0].dumps([value.obj for value in column]))
            elif form == ARRAY:
                values.append(self.array(column))
        return values

    @staticmethod
    def array(values: Sequence[Any]) -> Any:
        """A column's values as one parameter: integers as the array's text, which the
        server reads as an array of the column's type (psycopg dumps a list in Python,
        about 1.5 µs a value, and the text costs a tenth of that); else the list."""
        if all(type(value) is int for value in values):
            return "{" + ",".join(map(str, values)) + "}"
        return list(values)

    def pk_in(self, pk: str, size: int) -> str:
        # One array parameter, not one per item: psycopg caches the parsing of statements
        # with up to 50 parameters and re-parses the others on every execute.
        return f"{pk} = ANY(%s)"

    def pk_params(self, pks: list[Any]) -> list[Any]:
        # Integer keys as an array's text, which the server reads as an array of the
        # column's type. psycopg dumps a list in Python, 1 µs per key; a string at once.
        return [self.array(tuple(pks))]

    def lease_expiry(self, now: str) -> str:
        return f"{now} + %s"

    def lease_param(self, lease: timedelta) -> timedelta:
        return lease  # psycopg sends an interval

    def is_transient(self, exc: DatabaseError) -> bool:
        return getattr(exc.__cause__, "sqlstate", None) in TRANSIENT_SQLSTATES

    def approximate_count(self, queryset: QuerySet[Any]) -> int:
        """The planner's row estimate for ``queryset``: statistics only, no scan."""
        connection = connections[queryset.db]
        sql, params = queryset.values("pk").query.get_compiler(connection=connection).as_sql()
        with connection.cursor() as cursor:
            cursor.execute(f"EXPLAIN (FORMAT JSON) {sql}", params)
            plan = cursor.fetchone()[0]
        if isinstance(plan, str):
            plan = json.loads(plan)
        return int(plan[0]["Plan"]["Plan Rows"])

    def table_rows(self, queryset: QuerySet[Any]) -> int | None:
        """pg_class.reltuples: kept by VACUUM and ANALYZE; -1 until the table is analyzed."""
        connection = connections[queryset.db]
        table = connection.ops.quote_name(queryset.model._meta.db_table)
        with connection.cursor() as cursor:
            cursor.execute("SELECT reltuples FROM pg_class WHERE oid = to_regclass(%s)", [table])
            row = cursor.fetchone()
        return int(row[0]) if row and row[0] is not None and row[0] >= 0 else None

    def analyze(self, queryset: QuerySet[Any]) -> None:
        """VACUUM ANALYZE: the statistics, and the dead rows of deleted items gone (as
        autovacuum would, some time later), so the claim's index range holds none."""
        connection = connections[queryset.db]
        table = connection.ops.quote_name(queryset.model._meta.db_table)
        with connection.cursor() as cursor:
            cursor.execute(f"VACUUM ANALYZE {table}")

    def distinct_values(self, queryset: QuerySet[Any], field: str) -> list[Any]:
        """A skip scan, which PostgreSQL does not do by itself: a recursive query that
        jumps from each value to the next one through the index led by the field, one
        index probe per distinct value instead of a scan of every row."""
        connection = connections[queryset.db]
        table = connection.ops.quote_name(queryset.model._meta.db_table)
        column = connection.ops.quote_name(queryset.model._meta.get_field(field).column)
        with connection.cursor() as cursor:
            cursor.execute(
                f"WITH RECURSIVE v (value) AS ("
                f" (SELECT {column} FROM {table} ORDER BY {column} LIMIT 1)"
                f" UNION ALL SELECT (SELECT {column} FROM {table} WHERE {column} > v.value"
                f" ORDER BY {column} LIMIT 1) FROM v WHERE v.value IS NOT NULL"
                f") SELECT value FROM v WHERE value IS NOT NULL"
            )
            return [row[0] for row in cursor.fetchall()]

    def listen(self, alias: str, via: str) -> NotifyListener:
        return NotifyListener(alias, via)

    def is_disconnect(self, exc: Error) -> bool:
        if not hasattr(exc.__cause__, "sqlstate"):  # not psycopg's (another database's)
            return False
        sqlstate: str | None = getattr(exc.__cause__, "sqlstate", None)
        if sqlstate is None:
            # psycopg names no SQLSTATE when the server closed the connection, when none
            # could be made, or when it was closed already.
            return isinstance(exc, (OperationalError, InterfaceError))
        return sqlstate.startswith(DISCONNECT_CLASS) or sqlstate in DISCONNECT_SQLSTATES


@cache
def timestamptz_loader() -> tuple[int, Any]:
    """psycopg's own loader of ``timestamptz`` text (C, with psycopg's binary package)."""
    import psycopg

    oid = psycopg.postgres.types["timestamptz"].oid
    return oid, psycopg.adapters.get_loader(oid, psycopg.pq.Format.TEXT)


def connect(alias: str) -> Any:
    """A new autocommit psycopg connection with database ``alias``'s settings."""
    import psycopg

    params = connections[alias].get_connection_params()
    params.pop("cursor_factory", None)  # Django's cursor classes need its wrapper
    params.pop("context", None)
    return psycopg.connect(**params, autocommit=True)


class NotifyListener:
    """A dedicated autocommit connection, opened like database alias ``via``'s, LISTENing
    on the queue channel of database ``alias``.

    ``fileno()`` becomes readable when a notification arrives; ``drain()`` returns the
    queue names notified since the last call. Django's own connections are left alone.

    Before it listens on the queue channel it proves that notifications reach it: it
    listens on a channel of its own, and a notification sent there through ``alias``
    (as producers commit) must arrive within ``PROBE_TIMEOUT``. Behind a transaction
    pool it does not (the LISTEN ran on a server connection that went back to the pool
    and now serves other clients), and ``NotificationsLost`` is raised instead. The probe
    channel is never used again, so a pooled server connection left listening on it
    delivers nothing to anyone.
    """

    def __init__(self, alias: str, via: str) -> None:
        self.connection = connect(via)
        try:
            self._probe(alias, via)
            self.connection.execute(f"LISTEN {CHANNEL}")
        except BaseException:
            self.connection.close()
            raise

    def _probe(self, alias: str, via: str) -> None:
        channel = f"{CHANNEL}_probe_{secrets.token_hex(8)}"  # an identifier of our own
        self.connection.execute(f"LISTEN {channel}")
        # From a connection of its own, as a producer would: this thread's Django
        # connection may be inside a transaction that has not committed.
        with connect(alias) as sender:
            sender.execute("SELECT pg_notify(%s, '')", [channel])
        pgconn = self.connection.pgconn
        deadline = time.monotonic() + PROBE_TIMEOUT
        while (remaining := deadline - time.monotonic()) > 0:
            if select.select([self.fileno()], [], [], remaining)[0]:
                pgconn.consume_input()
                while (notification := pgconn.notifies()) is not None:
                    if notification.relname.decode() == channel:
                        self.connection.execute(f"UNLISTEN {channel}")
                        return
        # Best effort: through a transaction pool this may reach another server connection.
        self.connection.execute(f"UNLISTEN {channel}")
        raise NotificationsLost(
            f"a notification sent through database {alias!r} did not reach a LISTEN "
            f"through {via!r} within {PROBE_TIMEOUT} s"
        )

    def fileno(self) -> int:
        return int(self.connection.fileno())

    def drain(self) -> set[str]:
        pgconn = self.connection.pgconn
        pgconn.consume_input()  # raises if the server went away
        names = set()
        while (notification := pgconn.notifies()) is not None:
            names.add(notification.extra.decode())
        return names

    def close(self) -> None:
        self.connection.close()


def json_array(values: Sequence[Any]) -> bool:
    """Whether a JSON column's values go as one JSON array: each psycopg's ``Jsonb`` of
    one ``dumps`` (what Django's JSONField binds), none an SQL NULL (which
    ``jsonb_array_elements`` would make JSON null)."""
    from psycopg.types.json import Jsonb

    dumps = getattr(values[0], "dumps", None)
    return dumps is not None and all(
        type(value) is Jsonb and value.dumps is dumps for value in values
    )
