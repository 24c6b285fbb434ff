"""SQLite: one writer at a time, so a claim is a single UPDATE ... RETURNING.

A single write statement takes SQLite's write lock up front and waits for it through
the connection's busy timeout, so concurrent consumers queue up instead of failing
with "database is locked". There are no row locks, hence no SKIP LOCKED strategy
(``resolve_strategy`` says so from the connection's features).
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.db import OperationalError

if TYPE_CHECKING:
    from django.db.models import QuerySet

    from . import ClaimStatement, ClaimValues


def claim_update_limit(claim: ClaimStatement, values: ClaimValues) -> list[Any]:
    """Reserve the first n ready rows and return them, atomically, in one statement."""
    candidates, candidate_params = claim.candidates()
    assignments, assignment_params = claim.assignments(values)
    sql = (
        f"UPDATE {claim.table} SET {assignments} "
        f"WHERE {claim.pk} IN ({candidates}) "
        f"RETURNING {claim.columns(qualified=False)}"
    )
    return claim.fetch(sql, assignment_params + candidate_params)


def lease_expiry(now: str) -> str:
    # SQLite's own date arithmetic, in the text format Django stores (UTC).
    return "STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'NOW', %s)"


def lease_param(lease: timedelta) -> str:
    return f"+{lease.total_seconds()} seconds"


def is_transient(exc: OperationalError) -> bool:
    return "database is locked" in str(exc)


def approximate_count(queryset: QuerySet[Any]) -> int:
    """SQLite keeps no usable row estimates; the partial index makes the exact count cheap."""
    return queryset.count()
