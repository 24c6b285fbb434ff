"""The contract between the queue and a database vendor: one ``Dialect`` per vendor.

A dialect holds what differs between databases, as named facts (like Django's
``DatabaseFeatures``) and as the SQL that only that vendor writes: the two claim
strategies, lease arithmetic, which errors are worth retrying and which are a lost
connection, a cheap row estimate, how an idle consumer hears of new work, and a lock that
is only ever tried. Dialects hold no connection (connections are per thread); every
method is given the one to use.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from django.db import DatabaseError, Error, NotSupportedError, connections, transaction

from .. import conf
from ..conf import STRATEGIES
from ..status import Status
from .rows import now_sql, quoted_column

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.db.models import Model, QuerySet

    from .acks import Ack, AckStatement
    from .compiler import ClaimStatement, ClaimValues


class NotificationsLost(Exception):  # noqa: N818 - a fact, not a failure of ours
    """A new listener's probe notification never reached it: LISTEN does not work on
    that connection (a transaction pool, such as PgBouncer's, stands between it and the
    server)."""


class Listener(Protocol):
    """A connection that becomes readable when the database announces new work."""

    def fileno(self) -> int: ...

    def drain(self) -> set[str]:
        """The queue names announced since the last call; raises if the connection broke."""
        ...

    def close(self) -> None: ...


class Uncounted(Exception):
    """A counting acknowledgement met a row it may not take (its claim was taken over,
    or something waits for it and its cancellation was requested): it was rolled back,
    and the acknowledgement is left to the plain statement and ``store.flows``."""


# ``Dialect.bulk_layout``: a column every row has the same value in, bound once.
SHARED = "shared"


def shared_columns(columns: Sequence[Sequence[Any]]) -> list[bool]:
    """Which columns hold the same value in every row (all but the payload, in an
    enqueue_many); never all of them: a bulk source needs one that gives the rows."""
    shared = [column.count(column[0]) == len(column) for column in columns]
    if all(shared):
        shared[0] = False
    return shared


class Dialect:
    vendor: ClassVar[str]
    # Producers wake consumers through the database itself (PostgreSQL's NOTIFY), so the
    # loopback datagrams of ``wakeup`` are not needed.
    has_notify: ClassVar[bool] = False
    # The claim strategies whose claims carry the last batch's acknowledgement
    # (``ack_and_claim``).
    acks_while_claiming: ClassVar[frozenset[str]] = frozenset()
    # How ``short_transaction`` begins one.
    begin_sql: ClassVar[str] = "BEGIN"
    # A consumer's claims start after its last claimed item (``ClaimValues.after``), so
    # that they do not read the index entries of the rows claimed before (``resume``).
    resumes_claims: ClassVar[bool] = False
    # Many rows are inserted from a few parameters (``bulk_layout``), not as VALUES.
    bulk_source: ClassVar[bool] = False

    # A statement that does nothing, which a migration runs for an index this database does
    # without (``has_partial_indexes``: MySQL's and MariaDB's partial indexes).
    no_op_sql: ClassVar[str] = "SELECT 1"

    def upsert_target(self, unique_fields: list[str]) -> list[str] | None:
        """An upsert's conflict target: the unique fields, or None where the database
        names none (MySQL's ON DUPLICATE KEY UPDATE takes any unique key)."""
        return unique_fields

    def locked(self, rows: QuerySet[Any], touch: str) -> QuerySet[Any]:
        """``rows`` to be read under locks held to the transaction's end, their writers'
        and lockers' turns taken: ``SELECT ... FOR UPDATE``. ``touch``: a column a database
        without row locks writes to itself first (``SQLite.locked``)."""
        return rows.select_for_update()

    def has_partial_indexes(self, connection: BaseDatabaseWrapper) -> bool:
        """Indexes over the rows matching a condition: PostgreSQL and SQLite."""
        return bool(connection.features.supports_partial_indexes)

    def supports_skip_locked(self, connection: BaseDatabaseWrapper) -> bool:
        """``SELECT ... FOR UPDATE SKIP LOCKED``: PostgreSQL, MySQL 8+, MariaDB 10.6+."""
        return bool(connection.features.has_select_for_update_skip_locked)

    def resolve_strategy(self, strategy: str, connection: BaseDatabaseWrapper) -> str:
        """Turn "auto" (the caller's, then ``CLAIM_STRATEGY``'s) into a strategy this
        database runs; refuse one it cannot."""
        if strategy not in STRATEGIES:
            raise ValueError(
                f"unknown claim strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}"
            )
        if strategy == "auto":
            strategy = conf.get("CLAIM_STRATEGY")
        skip_locked = self.supports_skip_locked(connection)
        if strategy == "auto":
            return "skip_locked" if skip_locked else "update_limit"
        if strategy == "skip_locked" and not skip_locked:
            raise NotSupportedError(
                f"claim strategy 'skip_locked' needs SELECT ... FOR UPDATE SKIP LOCKED, which "
                f"{connection.display_name} does not have; use 'update_limit' or 'auto'"
            )
        return strategy

    def claim_skip_locked(self, claim: ClaimStatement, values: ClaimValues) -> list[Any]:
        raise NotSupportedError(f"{self.vendor} has no SKIP LOCKED claim")

    def claim_update_limit(self, claim: ClaimStatement, values: ClaimValues) -> list[Any]:
        raise NotImplementedError

    def ack_and_claim(
        self, claim: ClaimStatement, values: ClaimValues, statement: AckStatement, ack: Ack
    ) -> tuple[int, list[Any]]:
        """Acknowledge ``ack`` (with ``statement``) and claim, together: with the strategy of
        ``acks_while_claiming``; return how many rows the acknowledgement changed and the
        claimed items."""
        raise NotSupportedError(f"{self.vendor} runs acknowledgements on their own")

    def acknowledge(self, statement: AckStatement, ack: Ack) -> int:
        """Run ``statement`` for ``ack``: how many rows it acknowledged. One that counts
        down runs in a transaction of its own (``Uncounted``, nothing written, if it may
        not take every item)."""
        connection = connections[statement.alias]
        if ack.dependents:
            with self.short_transaction(connection) as cursor:
                return self.ack_on(cursor, statement, ack)
        with self.hot_cursor(connection) as cursor:
            return self.ack_on(cursor, statement, ack)

    def ack_on(self, cursor: Any, statement: AckStatement, ack: Ack) -> int:
        """Acknowledge ``ack``'s items on ``cursor``, in the caller's transaction; one
        that counts down (``Ack.dependents`` given) then counts down what waits for them, in a
        second statement, begun once the first holds the rows: it reads every edge a
        producer added to them before. That one raises ``Uncounted`` (the transaction to
        be rolled back) unless it took every item: only then are the items it counts for
        known to be those it took, DONE."""
        pks = self.pk_params(list(ack.results))
        cursor.execute(*statement.bind(ack, pks))
        if not ack.dependents:
            return int(cursor.rowcount)
        if cursor.rowcount < len(ack.results):
            raise Uncounted
        cursor.execute(*statement.count_down(pks, len(ack.results)))
        return len(ack.results)

    @contextmanager
    def short_transaction(self, connection: BaseDatabaseWrapper) -> Iterator[Any]:
        """A transaction of the block's own, yielding a cursor. Outside any atomic block it
        is begun and ended by statements (``begin_sql``), two round trips fewer than
        ``atomic()``'s switching of autocommit off and on again (a tenth of a one-item
        claim on MySQL); inside one, a savepoint."""
        if connection.in_atomic_block or not connection.get_autocommit():
            with transaction.atomic(using=connection.alias), connection.cursor() as cursor:
                yield cursor
            return
        with connection.cursor() as cursor:
            cursor.execute(self.begin_sql)
            try:
                yield cursor
            except BaseException:
                with contextlib.suppress(DatabaseError):  # a lost connection lost it anyway
                    cursor.execute("ROLLBACK")
                raise
            cursor.execute("COMMIT")

    @contextmanager
    def hot_cursor(self, connection: BaseDatabaseWrapper) -> Iterator[Any]:
        """A cursor for the statements run once per batch or per enqueue (claims,
        acknowledgements, inserts)."""
        with connection.cursor() as cursor:
            yield cursor

    def fetch(self, claim: ClaimStatement, sql: str, params: list[Any]) -> list[Any]:
        """Run a statement that returns whole rows (``claim.columns()``) and load them."""
        with self.hot_cursor(connections[claim.alias]) as cursor:
            cursor.execute(sql, params)
            return claim.rows.load(cursor.fetchall())

    def shape(self, values: ClaimValues, *rest: Any) -> tuple[Any, ...]:
        """The key of a claim's SQL in ``ClaimStatement.sql``: whether it resumes, which
        queues lease apart, and the dialect's ``rest`` (a lock, a size)."""
        return (values.after is not None, tuple(values.lease_by_queue), *rest)

    def assignments_sql(self, claim: ClaimStatement, values: ClaimValues) -> str:
        """The claim's SET clause (``ClaimStatement.claimed_columns``), its lease from now:
        a CASE where its items' queues lease differently (``lease_by_queue``)."""
        expiry = self.lease_expiry(now_sql(connections[claim.alias]))
        if values.lease_by_queue:
            cases = f"WHEN {claim.column('queue')} = %s THEN {expiry} " * len(
                values.lease_by_queue
            )
            expiry = f"CASE {cases}ELSE {expiry} END"
        return claim.claimed_columns + expiry

    def leases(self, values: ClaimValues) -> list[Any]:
        """``assignments_sql``'s parameters of the lease: each queue's, then the claim's."""
        by_queue = [
            param
            for name, lease in values.lease_by_queue.items()
            for param in (name, self.lease_param(lease))
        ]
        return [*by_queue, self.lease_param(values.lease)]

    def lease_expiry(self, now: str) -> str:
        """SQL for ``now`` plus the lease, which is bound as ``lease_param``'s one %s."""
        raise NotImplementedError

    def lease_param(self, lease: timedelta) -> Any:
        raise NotImplementedError

    def is_transient(self, exc: DatabaseError) -> bool:
        """A conflict that refused a transaction, which wrote nothing and is worth running
        again: a deadlock, a Galera certification failure, a serialization failure, a
        lock-wait timeout, a busy file."""
        return False

    def is_disconnect(self, exc: Error) -> bool:
        """The connection is lost or no longer fit for writes (the server went away, shuts
        down, or became a read-only replica after a failover): drop it and reconnect.
        The database's failure, not the caller's: work it interrupted is not an attempt."""
        return False

    def is_galera(self, connection: BaseDatabaseWrapper) -> bool:
        """Whether the database is a node of a Galera cluster, where any writing
        transaction can be refused at COMMIT by another node's conflicting one."""
        return False

    def approximate_count(self, queryset: QuerySet[Any]) -> int:
        """Rows ``queryset`` would return, estimated without a scan where possible."""
        return queryset.count()

    def estimated_count(self, queryset: QuerySet[Any], exact_up_to: int) -> int:
        """How many rows ``queryset`` has, never reading more than ``exact_up_to + 1`` of
        them: exact up to ``exact_up_to`` (its filters' indexes find them), beyond that
        the planner's estimate, never below the rows counted (exact again where the
        database keeps no statistics: SQLite)."""
        counted = queryset.order_by().values("pk")[: exact_up_to + 1].count()
        if counted <= exact_up_to:
            return counted
        return max(self.approximate_count(queryset), counted)

    def table_rows(self, queryset: QuerySet[Any]) -> int | None:
        """The number of rows in ``queryset``'s table from the statistics (no scan), or
        None where the database keeps none; only worth asking of an unfiltered queryset."""
        return None

    def queues_with_due_items(self, model: type[Model], alias: str, names: list[str]) -> set[str]:
        """Which of the queues ``names`` have a READY item due now, in one statement: a
        test per name that stops at its first row (``has_a_row``), each a probe of the
        READY index (never a scan of a busy queue's items, as a DISTINCT over them would
        be). The names come as a derived table of bound values, which all three vendors
        read (no VALUES list, no unnest)."""
        if not names:
            return set()
        connection = connections[alias]
        table = connection.ops.quote_name(model._meta.db_table)
        queue, status, run_at = (
            quoted_column(connection, model, name) for name in ("queue", "status", "run_at")
        )
        named = " UNION ALL ".join(["SELECT %s AS name"] * len(names))
        rows = (
            f"SELECT 1 FROM {table} WHERE {queue} = names.name AND {status} = %s "
            f"AND {run_at} <= {now_sql(connection)}"
        )
        sql = f"SELECT names.name FROM ({named}) names WHERE {self.has_a_row(rows)}"
        with connection.cursor() as cursor:
            cursor.execute(sql, [*names, Status.READY])
            return {str(name) for (name,) in cursor.fetchall()}

    def has_a_row(self, select: str) -> str:
        """A condition true when ``select`` (correlated) gives a row, read up to its first."""
        return f"EXISTS ({select})"

    def distinct_values(self, queryset: QuerySet[Any], field: str) -> list[Any]:
        """The distinct values of ``field`` in ``queryset``'s table, sorted; fast where an
        index is led by the field (a loose index scan), which the vendors may override."""
        return list(queryset.order_by(field).values_list(field, flat=True).distinct())

    def analyze(self, queryset: QuerySet[Any]) -> None:
        """Fresh planner statistics for ``queryset``'s table, and the table as a quiet
        while would leave it: for measurements that must each start from the same kind of
        table (``txqueue_bench``), never on a consumer's path."""
        raise NotImplementedError

    def purge_progress(self, connection: BaseDatabaseWrapper) -> tuple[int, int] | None:
        """Where the server's background removal of deleted rows stands: its next
        transaction id and the id below which the removal is done. None where deleted
        rows need no waiting for (their removal is ``analyze``'s or immediate), or when
        the server does not say."""
        return None

    @contextmanager
    def try_lock(self, connection: BaseDatabaseWrapper, name: str) -> Iterator[bool]:
        """Take the lock ``name``, one holder per database across processes and hosts, if
        nobody holds it, never waiting; yield whether it was taken, and release it after.

        A named lock, not of rows, so it blocks no claim, and dies with the connection if
        the holder does. Here a lock of the session (MySQL's GET_LOCK); PostgreSQL's is
        of a transaction that the work under it runs in (inside a caller's transaction,
        held until that one ends), so keep that work short.
        """
        take, release, key = self.lock_sql(connection, name)
        with connection.cursor() as cursor:
            cursor.execute(take, [key])
            taken = bool(cursor.fetchone()[0])
        try:
            yield taken
        finally:
            if taken:
                with connection.cursor() as cursor:
                    cursor.execute(release, [key])

    def lock_sql(self, connection: BaseDatabaseWrapper, name: str) -> tuple[str, str, Any]:
        """``try_lock``'s two statements, one that tries (answering true when taken) and
        one that releases, and the key both take as their parameter."""
        raise NotImplementedError

    def announce(self, connection: BaseDatabaseWrapper, queue: str) -> None:
        """Tell the consumers listening on this database, at commit, that ``queue`` has
        work (a resumed queue: no INSERT fires the announcement). Nothing where the
        database has no LISTEN: consumers poll, or hear a local wake-up."""

    def listen(self, alias: str, via: str) -> Listener | None:
        """A listener for new-work announcements on database ``alias``, connected like
        alias ``via`` (``alias`` itself, or LISTEN_DATABASES' choice), or None where the
        database has none. ``NotificationsLost`` if announcements cannot reach it."""
        return None

    def bulk_layout(
        self, connection: BaseDatabaseWrapper, types: list[str], columns: Sequence[Sequence[Any]]
    ) -> tuple[str, ...] | None:
        """How the bulk source carries each column of many rows (``columns``, a sequence of
        values per column, of ``types``): ``SHARED`` where every row has the same value,
        bound once; the dialect's own forms for the others. None where rows go as VALUES
        (SQLite binds thousands of parameters faster than it would read them from JSON).
        Called only where ``bulk_source``."""
        return None

    def bulk_rows(
        self, connection: BaseDatabaseWrapper, types: list[str], layout: tuple[str, ...]
    ) -> str:
        """The SELECT of an INSERT's many rows, of columns of ``types`` carried as
        ``layout`` says, from the parameters ``bulk_params`` makes."""
        raise NotSupportedError(f"{self.vendor} inserts many rows as VALUES")

    def bulk_params(self, columns: Sequence[Sequence[Any]], layout: tuple[str, ...]) -> list[Any]:
        """``bulk_rows``' parameters for ``columns``: the shared values, then the
        source's; TypeError if they cannot be sent so (they then go as VALUES)."""
        raise NotSupportedError(f"{self.vendor} inserts many rows as VALUES")

    def pk_in(self, pk: str, size: int) -> str:
        """SQL matching ``size`` primary keys, bound as ``pk_params`` of them."""
        return f"{pk} IN ({', '.join(['%s'] * size)})"

    def pk_params(self, pks: list[Any]) -> list[Any]:
        return pks

    def ack_update(
        self,
        table: str,
        columns: dict[str, str],
        status: str,
        now: str,
        size: int,
        results: bool,
        counting: bool = False,
        one_count: bool = False,
    ) -> str:
        """The fenced acknowledgement's UPDATE (``acks.AckStatement``).

        Parameters: ``status``'s, then (pk, result) pairs when ``results``, then
        ``pk_params`` of the pks, then IN_PROGRESS and the claim token: only rows still held
        by that claim change. Where the model has ``dependent_count``, the rows something
        waits for are left to ``store.flows``; ``counting``, only those whose count
        changed since the claim (bound as (pk, count) pairs, last; where the claim read
        the same count on every row, ``one_count``, as that count alone) or whose
        cancellation was requested: ``ack_on`` counts down for the others. ``columns``
        maps field names to quoted columns; a model without ``result`` and
        ``finished_at`` (a plain QueueModel) has neither set.
        """
        pk, assignments = columns["pk"], [f"{columns['status']} = {status}"]
        if "result" in columns:
            result = "CASE " + f"WHEN {pk} = %s THEN %s " * size + "END" if results else "NULL"
            assignments += [f"{columns['result']} = {result}", f"{columns['finished_at']} = {now}"]
        assignments.append(f"{columns['lease_expires_at']} = NULL")
        waited_for = columns.get("dependent_count")
        if waited_for and counting:
            claimed = "%s" if one_count else f"CASE {pk} " + "WHEN %s THEN %s " * size + "END"
            waited_for = (
                f"{waited_for} = {claimed} "
                f"AND ({waited_for} = 0 OR {columns['cancel_requested_at']} IS NULL)"
            )
        elif waited_for:
            waited_for = f"{waited_for} = 0"
        return (
            f"UPDATE {table} SET {', '.join(assignments)} "
            f"WHERE {self.pk_in(pk, size)} "
            f"AND {columns['status']} = %s AND {columns['claim_token']} = %s"
            + (f" AND {waited_for}" if waited_for else "")
        )

    def count_down_params(self, pk_params: list[Any]) -> list[Any]:
        """``count_down_update``'s parameters, ``pk_params`` of the items acknowledged."""
        ready, waiting = int(Status.READY), int(Status.WAITING)
        return [*pk_params, ready, *pk_params, waiting, *pk_params]

    def count_down_update(self, items: str, edges: str, columns: dict[str, str], size: int) -> str:
        """``AckStatement.count_down``'s UPDATE: each WAITING item with edges to the
        ``size`` items acknowledged counts down by their number, READY at zero.
        Parameters: ``pk_params`` of those items, READY, the pks again, WAITING, the pks
        again. ``status`` is assigned first: MySQL assigns left to right, and reads
        ``waiting_for`` there."""
        pk, status, waiting = columns["pk"], columns["status"], columns["waiting_for"]
        item, parent = columns["edge_item"], columns["edge_parent"]
        edges_to = f"{edges}.{item} = {items}.{pk} AND {self.pk_in(f'{edges}.{parent}', size)}"
        counted = f"(SELECT COUNT(*) FROM {edges} WHERE {edges_to})"
        return (
            f"UPDATE {items} SET {status} = CASE WHEN {waiting} <= {counted} THEN %s "
            f"ELSE {status} END, {waiting} = {waiting} - {counted} "
            f"WHERE {status} = %s "
            f"AND {pk} IN (SELECT {item} FROM {edges} WHERE {self.pk_in(parent, size)})"
        )
