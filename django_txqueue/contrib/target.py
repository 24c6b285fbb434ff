"""Where a tool's run works: one database alias and one queue name of its own.

``txqueue_bench`` and ``txqueue_chaos`` read and write only the rows of that queue, so a
run never touches real items of the same table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from django.db import connections, transaction

from django_txqueue.api import Queue
from django_txqueue.db import dialect
from django_txqueue.models import Consumer, QueueItem

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.db.models import QuerySet

FILL_CHUNK = 5000  # items per enqueue_many when filling a backlog


@dataclass(frozen=True)
class Target:
    """Where a run works: database ``alias``, items of ``queue`` only."""

    alias: str
    queue: str

    @property
    def connection(self) -> BaseDatabaseWrapper:
        return connections[self.alias]

    @property
    def vendor(self) -> str:
        return str(self.connection.vendor)

    @property
    def table(self) -> str:
        """The items table's name, quoted for this database's SQL."""
        return str(self.connection.ops.quote_name(QueueItem._meta.db_table))

    def items(self) -> QuerySet[QueueItem]:
        return QueueItem.objects.using(self.alias).filter(queue=self.queue)

    def clear(self) -> None:
        """Delete this queue's items (and nothing else)."""
        self.items().delete()

    def fill(self, count: int) -> None:
        """``count`` READY items ``{"n": n}``, enqueued the ordinary way."""
        queue = Queue(self.queue, using=self.alias)
        for start in range(0, count, FILL_CHUNK):
            with transaction.atomic(using=self.alias):
                queue.enqueue_many(
                    [{"n": n} for n in range(start, min(start + FILL_CHUNK, count))]
                )

    def analyze(self) -> None:
        """Fresh planner statistics (and, on PostgreSQL, dead rows of earlier rounds gone),
        so that every round starts from the same kind of table."""
        statement = {
            "postgresql": "VACUUM ANALYZE {}",
            "mysql": "ANALYZE TABLE {}",
            "sqlite": "ANALYZE {}",
        }[self.vendor].format(self.table)
        with self.connection.cursor() as cursor:
            cursor.execute(statement)
            if self.vendor == "mysql":
                cursor.fetchall()
            if self.vendor == "sqlite":
                # Copy a big fill out of the write-ahead log now, not in the middle of a
                # measurement (the commit that crosses the auto-checkpoint size does it).
                cursor.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def forget_consumers(self, identities: list[str]) -> None:
        """Delete the Consumer rows the bench's own consumers left behind."""
        Consumer.objects.using(self.alias).filter(identity__in=identities).delete()

    def strategies(self) -> list[str]:
        """The claim strategies this database runs."""
        found = ["update_limit"]
        if dialect(self.connection).supports_skip_locked(self.connection):
            found.insert(0, "skip_locked")
        return found
