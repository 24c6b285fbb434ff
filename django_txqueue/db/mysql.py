"""MySQL and MariaDB: SKIP LOCKED in a short transaction, or the native UPDATE ... LIMIT.

InnoDB locks every index record a locking statement examines, so both claims rely on
the READY ``StatusIndex`` matching the WHERE and ORDER BY exactly: then they examine
only the rows they take.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.db import DatabaseError, Error, InterfaceError, connections

from ..status import Status
from .base import SHARED, Dialect, shared_columns

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.db.models import QuerySet

    from .acks import Ack, AckStatement
    from .compiler import ClaimStatement, ClaimValues

# ER_LOCK_DEADLOCK, ER_LOCK_WAIT_TIMEOUT. Galera reports both its refusals as 1213
# "Deadlock found": a certification failure at COMMIT (another node's transaction on the
# same rows committed first) and a brute-force abort (a replicated transaction needed a
# lock this one held). Either rolled the whole transaction back. (1047 "WSREP has not yet
# prepared node for application use" is a node out of the cluster: not a conflict.)
TRANSIENT_ERRORS = {1213, 1205}
# ``bulk_layout``: a column that varies goes in the JSON rows ``JSON_TABLE`` reads.
JSON_ROWS = "json rows"
# SHOW ENGINE INNODB STATUS: the next transaction id, and how far the purge has come.
TRX_COUNTER = re.compile(r"Trx id counter (\d+)")
PURGED_BELOW = re.compile(r"Purge done for trx's n:o < (\d+)")
HISTORY_LENGTH = re.compile(r"History list length (\d+)")
# Lost connections: CR_CONNECTION_ERROR, CR_CONN_HOST_ERROR, CR_SERVER_GONE_ERROR,
# CR_SERVER_LOST, CR_SERVER_LOST_EXTENDED, ER_SERVER_SHUTDOWN, ER_CONNECTION_KILLED,
# ER_CLIENT_INTERACTION_TIMEOUT, and ER_UNKNOWN_COM_ERROR, which a Galera node not
# ready (not in the primary component) answers every statement with.
DISCONNECT_ERRORS = {2002, 2003, 2006, 2013, 2055, 1053, 1927, 4031, 1047}


def uuid_text(value: Any) -> str:
    """A UUID as JSON carries it, its text, which MariaDB's native ``uuid`` column (Django
    uses it from MariaDB 10.7) reads back (a flow's id); other values JSON cannot carry
    raise TypeError, and their rows go as VALUES."""
    if isinstance(value, uuid.UUID):
        return str(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


class MySQL(Dialect):
    vendor = "mysql"
    acks_while_claiming = frozenset({"skip_locked"})
    bulk_source = True
    begin_sql = "START TRANSACTION"
    # Under READ COMMITTED, Django's default here, InnoDB steps over the READY index
    # entries of rows claimed since its purge last ran at several times the cost of a live
    # one: a claim of 100 from the head took 3 to 5 ms where one that resumes takes 0.7.
    resumes_claims = True
    no_op_sql = "DO 0"

    def __init__(self) -> None:
        super().__init__()
        self._galera: dict[str, bool] = {}

    def is_galera(self, connection: BaseDatabaseWrapper) -> bool:
        """``wsrep_on``, asked once per database alias."""
        alias = connection.alias
        if alias not in self._galera:
            with connection.cursor() as cursor:
                cursor.execute("SHOW VARIABLES LIKE 'wsrep_on'")
                row = cursor.fetchone()
            self._galera[alias] = row is not None and str(row[1]).upper() == "ON"
        return self._galera[alias]

    def upsert_target(self, unique_fields: list[str]) -> None:
        return None  # ON DUPLICATE KEY UPDATE: any unique key; Django refuses a target

    def claim_skip_locked(self, claim: ClaimStatement, values: ClaimValues) -> list[Any]:
        """Lock the first ready rows nobody else holds, read them, mark them claimed, in
        one short transaction."""
        return self._claim_skip_locked(claim, values, None)[1]

    def ack_and_claim(
        self, claim: ClaimStatement, values: ClaimValues, statement: AckStatement, ack: Ack
    ) -> tuple[int, list[Any]]:
        """The acknowledgement ``ack`` first in the skip_locked claim's transaction: one
        commit (one log flush) per batch instead of two. It changes only rows its claim
        holds and the claim never waits (SKIP LOCKED), so no lock cycle can form."""
        return self._claim_skip_locked(claim, values, (statement, ack))

    def _claim_skip_locked(
        self,
        claim: ClaimStatement,
        values: ClaimValues,
        ack: tuple[AckStatement, Ack] | None,
    ) -> tuple[int, list[Any]]:
        """Under READ COMMITTED a locking read costs about 30 us more per row when it reads
        whole rows than when it reads the READY index alone, which holds the primary key.
        So one row is locked and read at once; more are locked by the index, then read by
        primary key, which costs less than that from ten rows on (measured at 1, 10, 100).
        """
        connection = connections[claim.alias]
        lock = connection.ops.for_update_sql(skip_locked=True)
        whole_rows = claim.limit == 1
        params, assignment_params = claim.bind(
            values, self.leases(values), lock=lock, whole_rows=whole_rows
        )
        key = self.shape(values, whole_rows)
        if key not in claim.sql:
            candidates, _ = claim.candidates(lock, whole_rows=whole_rows, after=values.after)
            claim.sql[key] = self.read_ready_index(claim, candidates)
        claimed_by, acknowledged = (values.pid, values.token), 0
        with self.short_transaction(connection) as cursor:
            if ack is not None:
                acknowledged = self.ack_on(cursor, *ack)
            cursor.execute(claim.sql[key], params)
            if whole_rows:
                rows = claim.rows.load(cursor.fetchall(), claimed_by=claimed_by)
                pks = [row.pk for row in rows]
            else:
                pks = [pk for (pk,) in cursor.fetchall()]
            if not pks:
                return acknowledged, []
            pk_params = self.pk_params(pks)
            read, update = self._by_pk(claim, values, len(pks))
            if not whole_rows:
                cursor.execute(read, pk_params)
                loaded = claim.rows.load(cursor.fetchall(), claimed_by=claimed_by)
                by_pk = {row.pk: row for row in loaded}
                rows = [by_pk[pk] for pk in pks]  # in claim order
            cursor.execute(update, assignment_params + pk_params)
        return acknowledged, rows

    def _by_pk(self, claim: ClaimStatement, values: ClaimValues, size: int) -> tuple[str, str]:
        """The SELECT and the claiming UPDATE of ``size`` candidates by primary key."""
        key = self.shape(values, "by pk", size)
        if key not in claim.sql:
            where = self.pk_in(claim.pk, size)
            claim.sql[key] = f"SELECT {claim.columns()} FROM {claim.table} WHERE {where}"
            claim.sql[(*key, "update")] = (
                f"UPDATE {claim.table} SET {self.assignments_sql(claim, values)} WHERE {where}"
            )
        return claim.sql[key], claim.sql[(*key, "update")]

    @staticmethod
    def force_ready_index(claim: ClaimStatement) -> str:
        """`` FORCE INDEX (<READY index>)``, or "" for a model without one. InnoDB locks
        every row a locking statement examines: planned from statistics instead (a small
        or freshly emptied table, or the single-table UPDATE, which took the shorter
        (status, claim_token) index), a claim read and filesorted every READY row, locking
        them all, and the other consumers' claims skipped or waited for all of them. The
        READY index reads the rows in claim order and stops at the LIMIT."""
        return f" FORCE INDEX ({claim.quote(claim.ready_index)})" if claim.ready_index else ""

    def read_ready_index(self, claim: ClaimStatement, candidates: str) -> str:
        """The candidates' SELECT with its table (the first FROM: an ordered queue's
        subqueries come later) read through the READY index."""
        table = f"FROM {claim.table} "
        return candidates.replace(table, f"{table.rstrip()}{self.force_ready_index(claim)} ", 1)

    def claim_update_limit(self, claim: ClaimStatement, values: ClaimValues) -> list[Any]:
        """One atomic ``UPDATE ... ORDER BY ... LIMIT n``, then read back by the claim token.

        An UPDATE cannot return what it changed here, and reading back by pid and status
        would also find this consumer's older claims: the token names this one only.
        """
        where, order, where_params = claim.where_and_order(values.after)
        assignments = self.assignments_sql(claim, values)
        assignment_params = claim.assigned(values, self.leases(values))
        table = claim.table + self.force_ready_index(claim)
        with connections[claim.alias].cursor() as cursor:
            cursor.execute(
                f"UPDATE {table} SET {assignments} WHERE {where} ORDER BY {order} LIMIT %s",
                assignment_params + where_params + [claim.limit],
            )
            if cursor.rowcount == 0:
                return []
        return self.fetch(
            claim,
            f"SELECT {claim.columns()} FROM {claim.table} "
            f"WHERE {claim.column('status')} = %s AND {claim.column('claim_token')} = %s",
            [int(Status.IN_PROGRESS), values.token],
        )

    def bulk_layout(
        self, connection: BaseDatabaseWrapper, types: list[str], columns: Sequence[Sequence[Any]]
    ) -> tuple[str, ...] | None:
        """The columns that vary in one JSON array of rows (``JSON_ROWS``), read by
        ``JSON_TABLE``: one parameter for a thousand rows, where mysqlclient quotes each
        of ten thousand in Python (about 7 us of CPU a row, against 1). MariaDB 10.6 and
        MySQL 8.0.4 on."""
        mariadb, version = connection.mysql_is_mariadb, connection.mysql_version  # type: ignore[attr-defined]
        if version < ((10, 6) if mariadb else (8, 0, 4)):
            return None
        return tuple(SHARED if shared else JSON_ROWS for shared in shared_columns(columns))

    def bulk_rows(
        self, connection: BaseDatabaseWrapper, types: list[str], layout: tuple[str, ...]
    ) -> str:
        """Each value in the JSON rows is read as text and converted by the INSERT, as a
        quoted VALUES one would be: JSON_TABLE's own types would cut a string too long
        for its column, or make a number out of range NULL, without an error. Booleans
        (JSON true and false) keep their type; a JSON value (given as the string of its
        text) stays that text. A shared value is bound as VALUES binds it."""
        varying = [t for t, form in zip(types, layout, strict=True) if form != SHARED]
        columns = ", ".join(
            f"c{n} {'bool' if column_type == 'bool' else 'longtext'} PATH '$[{n}]'"
            for n, column_type in enumerate(varying)
        )
        names = iter(f"j.c{n}" for n in range(len(varying)))
        values = ", ".join("%s" if form == SHARED else next(names) for form in layout)
        return (
            f"SELECT {values} FROM JSON_TABLE(%s, '$[*]' COLUMNS "
            f"(n FOR ORDINALITY, {columns})) AS j ORDER BY j.n"
        )

    def bulk_params(self, columns: Sequence[Sequence[Any]], layout: tuple[str, ...]) -> list[Any]:
        values = [
            column[0] for column, form in zip(columns, layout, strict=True) if form == SHARED
        ]
        varying = [c for c, form in zip(columns, layout, strict=True) if form != SHARED]
        rows = zip(*varying, strict=True)
        return [*values, json.dumps(list(rows), default=uuid_text)]

    def lock_sql(self, connection: BaseDatabaseWrapper, name: str) -> tuple[str, str, Any]:
        """``GET_LOCK`` with no wait. Its names are server-wide (and MySQL's at most 64
        characters), so the lock's name includes the database's."""
        lock = f"{name}:{connection.settings_dict['NAME']}"[:64]
        return "SELECT GET_LOCK(%s, 0)", "SELECT RELEASE_LOCK(%s)", lock

    def lease_expiry(self, now: str) -> str:
        return f"{now} + INTERVAL %s MICROSECOND"

    def lease_param(self, lease: timedelta) -> int:
        return lease // timedelta(microseconds=1)

    def is_transient(self, exc: DatabaseError) -> bool:
        return bool(exc.args) and exc.args[0] in TRANSIENT_ERRORS

    def table_rows(self, queryset: QuerySet[Any]) -> int | None:
        """InnoDB's estimate in information_schema (off by up to ~50%, never a scan)."""
        connection = connections[queryset.db]
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT TABLE_ROWS FROM information_schema.TABLES"
                " WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s",
                [queryset.model._meta.db_table],
            )
            row = cursor.fetchone()
        return int(row[0]) if row and row[0] is not None else None

    def analyze(self, queryset: QuerySet[Any]) -> None:
        """ANALYZE TABLE (whose result rows must be read before the next statement)."""
        connection = connections[queryset.db]
        table = connection.ops.quote_name(queryset.model._meta.db_table)
        with connection.cursor() as cursor:
            cursor.execute(f"ANALYZE TABLE {table}")
            cursor.fetchall()

    def has_a_row(self, select: str) -> str:
        """Not EXISTS: MariaDB turns that into a semi-join that reads every matching row
        of the subquery's index range once (a busy queue's every READY row); a scalar
        subquery with LIMIT 1 stays a probe per outer row."""
        return f"({select} LIMIT 1) IS NOT NULL"

    def purge_progress(self, connection: BaseDatabaseWrapper) -> tuple[int, int] | None:
        """InnoDB keeps a deleted row's index entries, delete-marked, until its purge
        thread removes them: claims read past those in the READY range meanwhile. From
        SHOW ENGINE INNODB STATUS, which needs the PROCESS privilege (None without)."""
        try:
            with connection.cursor() as cursor:
                cursor.execute("SHOW ENGINE INNODB STATUS")
                text = str(cursor.fetchone()[-1])
        except DatabaseError:
            return None
        return purge_status(text)

    def is_disconnect(self, exc: Error) -> bool:
        # mysqlclient's InterfaceError (0, '') is a statement on a closed connection.
        if isinstance(exc, InterfaceError):
            return True
        return bool(exc.args) and exc.args[0] in DISCONNECT_ERRORS

    def approximate_count(self, queryset: QuerySet[Any]) -> int:
        """InnoDB's row estimate for ``queryset`` from EXPLAIN (index dives, no scan)."""
        connection = connections[queryset.db]
        sql, params = queryset.values("pk").query.get_compiler(connection=connection).as_sql()
        with connection.cursor() as cursor:
            cursor.execute(f"EXPLAIN {sql}", params)
            names = [column[0] for column in cursor.description]
            return sum(int(row[names.index("rows")] or 0) for row in cursor.fetchall())


def purge_status(text: str) -> tuple[int, int] | None:
    """The next transaction id and the id below which InnoDB's purge is done, from the
    text of SHOW ENGINE INNODB STATUS. With nothing left to purge (an empty history
    list) it is done up to the counter: its own mark can stay below the last transaction
    until another one comes."""
    counter, purged = TRX_COUNTER.search(text), PURGED_BELOW.search(text)
    if counter is None or purged is None:
        return None
    history = HISTORY_LENGTH.search(text)
    if history is not None and int(history.group(1)) == 0:
        return int(counter.group(1)), int(counter.group(1))
    return int(counter.group(1)), int(purged.group(1))
