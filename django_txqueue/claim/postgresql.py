"""PostgreSQL: claims as single statements, and the planner's row estimate."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from django.db import OperationalError, connections

from ..models import Status

if TYPE_CHECKING:
    from django.db.models import QuerySet

    from . import ClaimStatement

# How often an update_limit claim that lost all its rows to concurrent claims tries again.
LOST_RACE_RETRIES = 5
# serialization_failure, deadlock_detected
TRANSIENT_SQLSTATES = {"40001", "40P01"}


def claim_skip_locked(claim: ClaimStatement) -> list[Any]:
    """Lock the first ready rows nobody else holds and claim them, in one round trip."""
    candidates, candidate_params = claim.candidates("FOR UPDATE SKIP LOCKED")
    assignments, assignment_params = claim.assignments()
    sql = (
        f"WITH picked ({claim.pk}) AS MATERIALIZED ({candidates}) "
        f"UPDATE {claim.table} SET {assignments} FROM picked "
        f"WHERE {claim.table}.{claim.pk} = picked.{claim.pk} "
        f"RETURNING {claim.columns()}"
    )
    return claim.fetch(sql, candidate_params + assignment_params)


def claim_update_limit(claim: ClaimStatement) -> list[Any]:
    """Seed 003's reservation: claim the first n ready rows, waiting on locked ones.

    PostgreSQL has no UPDATE ... LIMIT; a locking, materialised sub-SELECT with LIMIT
    is its equivalent (unmaterialised, the planner may re-run it and claim more than
    n). A row another transaction holds is waited for and re-checked, and dropped if
    it stopped being READY meanwhile. Unlike InnoDB, PostgreSQL does not then read on
    past it, so a claim that lost every row to a concurrent one is run again while
    ready rows remain.
    """
    candidates, candidate_params = claim.candidates("FOR UPDATE")
    assignments, assignment_params = claim.assignments()
    sql = (
        f"WITH picked ({claim.pk}) AS MATERIALIZED ({candidates}) "
        f"UPDATE {claim.table} SET {assignments} FROM picked "
        f"WHERE {claim.table}.{claim.pk} = picked.{claim.pk} "
        f"AND {claim.table}.{claim.column('status')} = %s "
        f"RETURNING {claim.columns()}"
    )
    params = candidate_params + assignment_params + [Status.READY]
    for _ in range(LOST_RACE_RETRIES):
        items = claim.fetch(sql, params)
        if items or not claim.queryset.exists():
            return items
    return []


def is_transient(exc: OperationalError) -> bool:
    return getattr(exc.__cause__, "sqlstate", None) in TRANSIENT_SQLSTATES


def approximate_count(queryset: QuerySet[Any]) -> int:
    """The planner's row estimate for ``queryset``: statistics only, no scan."""
    connection = connections[queryset.db]
    sql, params = queryset.values("pk").query.get_compiler(connection=connection).as_sql()
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN (FORMAT JSON) {sql}", params)
        plan = cursor.fetchone()[0]
    if isinstance(plan, str):
        plan = json.loads(plan)
    return int(plan[0]["Plan"]["Plan Rows"])
