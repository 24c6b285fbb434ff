"""MySQL and MariaDB: SKIP LOCKED in a short transaction, or the native UPDATE ... LIMIT.

InnoDB locks every index record a locking statement examines, so both claims rely on
the READY ``StatusIndex`` matching the WHERE and ORDER BY exactly: then they examine
only the rows they take.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.db import DatabaseError, connections, transaction

from ..status import Status
from .base import Dialect

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.db.models import QuerySet

    from .compiler import ClaimStatement, ClaimValues

# ER_LOCK_DEADLOCK, ER_LOCK_WAIT_TIMEOUT
TRANSIENT_ERRORS = {1213, 1205}


class MySQL(Dialect):
    vendor = "mysql"
    acks_while_claiming = True

    def claim_skip_locked(self, claim: ClaimStatement, values: ClaimValues) -> list[Any]:
        """Lock (and read) the first ready rows nobody else holds, mark them claimed, commit.

        The locking SELECT already returns whole rows, so no read-back is needed: two
        statements per claim, in one short transaction.
        """
        return self._claim_skip_locked(claim, values, None)[1]

    def ack_and_claim(
        self, claim: ClaimStatement, values: ClaimValues, ack: tuple[str, list[Any]]
    ) -> tuple[int, list[Any]]:
        """The acknowledgement ``ack`` first in the skip_locked claim's transaction: one
        commit (one log flush) per batch instead of two. It changes only rows its claim
        holds and the claim never waits (SKIP LOCKED), so no lock cycle can form."""
        return self._claim_skip_locked(claim, values, ack)

    def _claim_skip_locked(
        self, claim: ClaimStatement, values: ClaimValues, ack: tuple[str, list[Any]] | None
    ) -> tuple[int, list[Any]]:
        connection = claim.connection
        lock = connection.ops.for_update_sql(skip_locked=True)
        candidates, params = claim.candidates(lock, whole_rows=True)
        acknowledged = 0
        with transaction.atomic(using=connection.alias):
            if ack is not None:
                with connection.cursor() as cursor:
                    cursor.execute(*ack)
                    acknowledged = cursor.rowcount
            items = claim.fetch(candidates, params)
            if not items:
                return acknowledged, []
            assignments, assignment_params = claim.assignments(values)
            with connection.cursor() as cursor:
                cursor.execute(
                    f"UPDATE {claim.table} SET {assignments} "
                    f"WHERE {self.pk_in(claim.pk, len(items))}",
                    assignment_params + self.pk_params([item.pk for item in items]),
                )
        return acknowledged, claim.mark_claimed(items, values)

    def claim_update_limit(self, claim: ClaimStatement, values: ClaimValues) -> list[Any]:
        """One atomic ``UPDATE ... ORDER BY ... LIMIT n``, then read back by the claim token.

        An UPDATE cannot return what it changed here, and reading back by pid and status
        would also find this consumer's older claims: the token names this one only.
        """
        where, order, where_params = claim.where_and_order()
        assignments, assignment_params = claim.assignments(values)
        table = claim.table
        if claim.ready_index:
            # The single-table UPDATE planner would pick the shorter (status, claim_token)
            # index and filesort every READY row, locking them all; the READY index reads
            # the rows in claim order and stops at the LIMIT.
            table += f" FORCE INDEX ({claim.quote(claim.ready_index)})"
        with claim.connection.cursor() as cursor:
            cursor.execute(
                f"UPDATE {table} SET {assignments} WHERE {where} ORDER BY {order} LIMIT %s",
                assignment_params + where_params + [claim.limit],
            )
            if cursor.rowcount == 0:
                return []
        return claim.fetch(
            f"SELECT {claim.columns()} FROM {claim.table} "
            f"WHERE {claim.column('status')} = %s AND {claim.column('claim_token')} = %s",
            [int(Status.IN_PROGRESS), values.token],
        )

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

    def approximate_count(self, queryset: QuerySet[Any]) -> int:
        """InnoDB's row estimate for ``queryset`` from EXPLAIN (index dives, no scan)."""
        connection = connections[queryset.db]
        sql, params = queryset.values("pk").query.get_compiler(connection=connection).as_sql()
        with connection.cursor() as cursor:
            cursor.execute(f"EXPLAIN {sql}", params)
            names = [column[0] for column in cursor.description]
            return sum(int(row[names.index("rows")] or 0) for row in cursor.fetchall())
