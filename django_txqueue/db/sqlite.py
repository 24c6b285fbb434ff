"""SQLite: one writer at a time, so a claim is a single UPDATE ... RETURNING.

A single write statement takes SQLite's write lock up front and waits for it through
the connection's busy timeout, so concurrent consumers queue up instead of failing
with "database is locked". There are no row locks, hence no SKIP LOCKED strategy
(Django's features say so).
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.db import DatabaseError

from .base import Dialect

if TYPE_CHECKING:
    from .compiler import ClaimStatement, ClaimValues


class SQLite(Dialect):
    vendor = "sqlite"

    def claim_update_limit(self, claim: ClaimStatement, values: ClaimValues) -> list[Any]:
        """Reserve the first n ready rows and return them, atomically, in one statement."""
        candidates, candidate_params = claim.candidates()
        assignments, assignment_params = claim.assignments(values)
        sql = (
            f"UPDATE {claim.table} SET {assignments} "
            f"WHERE {claim.pk} IN ({candidates}) "
            f"RETURNING {claim.columns(qualified=False)}"
        )
        return claim.fetch(sql, assignment_params + candidate_params)

    def lease_expiry(self, now: str) -> str:
        # SQLite's own date arithmetic, in the text format Django stores (UTC).
        return "STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'NOW', %s)"

    def lease_param(self, lease: timedelta) -> str:
        return f"+{lease.total_seconds()} seconds"

    def is_transient(self, exc: DatabaseError) -> bool:
        return "database is locked" in str(exc)
