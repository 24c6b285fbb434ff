"""MySQL and MariaDB: SKIP LOCKED in a short transaction, or seed 003's UPDATE ... LIMIT.

InnoDB locks every index record a locking statement examines, so both claims rely on
the READY ``StatusIndex`` matching the WHERE and ORDER BY exactly: then they examine
only the rows they take.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.db import OperationalError, connections, transaction

from ..models import Status

if TYPE_CHECKING:
    from django.db.models import QuerySet

    from . import ClaimStatement, ClaimValues

# ER_LOCK_DEADLOCK, ER_LOCK_WAIT_TIMEOUT
TRANSIENT_ERRORS = {1213, 1205}


def claim_skip_locked(claim: ClaimStatement, values: ClaimValues) -> list[Any]:
    """Lock (and read) the first ready rows nobody else holds, mark them claimed, commit.

    The locking SELECT already returns whole rows, so no read-back is needed: two
    statements per claim, in one short transaction.
    """
    lock = claim.connection.ops.for_update_sql(skip_locked=True)
    candidates, params = claim.candidates(lock, whole_rows=True)
    with transaction.atomic(using=claim.connection.alias):
        items = claim.fetch(candidates, params)
        if not items:
            return []
        assignments, assignment_params = claim.assignments(values)
        with claim.connection.cursor() as cursor:
            cursor.execute(
                f"UPDATE {claim.table} SET {assignments} "
                f"WHERE {claim.pk} IN ({', '.join(['%s'] * len(items))})",
                assignment_params + [item.pk for item in items],
            )
    return claim.mark_claimed(items, values)


def claim_update_limit(claim: ClaimStatement, values: ClaimValues) -> list[Any]:
    """One atomic ``UPDATE ... ORDER BY ... LIMIT n``, then read back by the claim token."""
    where, order, where_params = claim.where_and_order()
    assignments, assignment_params = claim.assignments(values)
    with claim.connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {claim.table} SET {assignments} WHERE {where} ORDER BY {order} LIMIT %s",
            assignment_params + where_params + [claim.limit],
        )
        if cursor.rowcount == 0:
            return []
    return read_back(claim, values)


def read_back(claim: ClaimStatement, values: ClaimValues) -> list[Any]:
    """The rows this claim reserved: by its own token, never by pid and status alone."""
    return claim.fetch(
        f"SELECT {claim.columns()} FROM {claim.table} "
        f"WHERE {claim.column('status')} = %s AND {claim.column('claim_token')} = %s",
        [Status.IN_PROGRESS, values.token],
    )


def lease_expiry(now: str) -> str:
    return f"{now} + INTERVAL %s MICROSECOND"


def lease_param(lease: timedelta) -> int:
    return lease // timedelta(microseconds=1)


def is_transient(exc: OperationalError) -> bool:
    return bool(exc.args) and exc.args[0] in TRANSIENT_ERRORS


def approximate_count(queryset: QuerySet[Any]) -> int:
    """InnoDB's row estimate for ``queryset`` from EXPLAIN (index dives, no scan)."""
    connection = connections[queryset.db]
    sql, params = queryset.values("pk").query.get_compiler(connection=connection).as_sql()
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN {sql}", params)
        names = [column[0] for column in cursor.description]
        return sum(int(row[names.index("rows")] or 0) for row in cursor.fetchall())
