"""SQLite: one writer at a time, so a claim is a single UPDATE ... RETURNING.

A single write statement takes SQLite's write lock up front and waits for it through
the connection's busy timeout, so concurrent consumers queue up instead of failing
with "database is locked". There are no row locks, hence no SKIP LOCKED strategy
(Django's features say so).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.db import DatabaseError, connections
from django.db.models import F

from .base import Dialect

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.db.models import QuerySet

    from .acks import Ack, AckStatement
    from .compiler import ClaimStatement, ClaimValues


class SQLite(Dialect):
    vendor = "sqlite"
    # The acknowledgement in the claim's transaction: one commit per batch, not two.
    acks_while_claiming = frozenset({"update_limit"})
    # Takes the write lock at once, waiting for it through the busy timeout: a deferred
    # transaction that read first could not wait for it later.
    begin_sql = "BEGIN IMMEDIATE"

    def locked(self, rows: QuerySet[Any], touch: str) -> QuerySet[Any]:
        """SQLite locks the database, not rows: a write first (``touch`` set to itself)
        takes its write lock before the read. A transaction that read first would hold a
        read lock that two of them could not both upgrade."""
        rows.update(**{touch: F(touch)})
        return rows

    def claim_update_limit(self, claim: ClaimStatement, values: ClaimValues) -> list[Any]:
        """Reserve the first n ready rows and return them, atomically, in one statement."""
        candidate_params, assignment_params = claim.bind(values, self.leases(values))
        key = self.shape(values)
        if key not in claim.sql:
            candidates, _ = claim.candidates(after=values.after)
            claim.sql[key] = (
                f"UPDATE {claim.table} SET {self.assignments_sql(claim, values)} "
                f"WHERE {claim.pk} IN ({candidates}) "
                f"RETURNING {claim.columns(qualified=False)}"
            )
        return self.fetch(claim, claim.sql[key], assignment_params + candidate_params)

    def ack_and_claim(
        self, claim: ClaimStatement, values: ClaimValues, statement: AckStatement, ack: Ack
    ) -> tuple[int, list[Any]]:
        """The acknowledgement ``ack`` and the claim in one transaction."""
        with self.short_transaction(connections[claim.alias]) as cursor:
            return self.ack_on(cursor, statement, ack), self.claim_update_limit(claim, values)

    @contextmanager
    def try_lock(self, connection: BaseDatabaseWrapper, name: str) -> Iterator[bool]:
        """SQLite has no named locks, and its write lock would stop every claim: a
        non-blocking ``flock`` of a file beside the database instead (one host shares a
        SQLite file). An in-memory database (or a ``file:`` URI), or a system without
        ``flock``, goes without: every try succeeds."""
        database = str(connection.settings_dict["NAME"])
        if fcntl is None or database == ":memory:" or database.startswith("file:"):
            yield True
            return
        fd = os.open(f"{database}-{name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
            else:
                yield True
        finally:
            os.close(fd)  # releases the lock

    def analyze(self, queryset: QuerySet[Any]) -> None:
        """ANALYZE, then a checkpoint that copies the write-ahead log into the database
        file: a big fill is copied now, not by the commit that crosses the auto-checkpoint
        size in the middle of whatever runs next."""
        connection = connections[queryset.db]
        table = connection.ops.quote_name(queryset.model._meta.db_table)
        with connection.cursor() as cursor:
            cursor.execute(f"ANALYZE {table}")
            cursor.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def lease_expiry(self, now: str) -> str:
        # SQLite's own date arithmetic, in the text format Django stores (UTC).
        return "STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'NOW', %s)"

    def lease_param(self, lease: timedelta) -> str:
        return f"+{lease.total_seconds()} seconds"

    def is_transient(self, exc: DatabaseError) -> bool:
        return "database is locked" in str(exc)
