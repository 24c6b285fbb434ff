"""Where a tool's run works: one database alias and one queue name of its own.

``txqueue_bench`` and ``txqueue_chaos`` read and write only the rows of that queue, so a
run never touches real items of the same table; they change them only through the
queue's public API and ``django_txqueue.store``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from django.db import connections, transaction

from django_txqueue import Consumer, Queue, QueueItem, store
from django_txqueue.db import dialect

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
    def database_name(self) -> str:
        """The database's name, as a person judges it: on SQLite the file's name, whose
        directories say nothing of the database (other databases' names have no "/")."""
        return Path(str(self.connection.settings_dict["NAME"])).name

    def items(self) -> QuerySet[QueueItem]:
        return QueueItem.objects.using(self.alias).filter(queue=self.queue)

    def clear(self) -> None:
        """Delete this queue's items (and nothing else)."""
        store.delete_all(self.items())

    def fill(self, count: int) -> None:
        """``count`` READY items ``{"n": n}``, enqueued the ordinary way."""
        queue = Queue(self.queue, using=self.alias)
        for start in range(0, count, FILL_CHUNK):
            with transaction.atomic(using=self.alias):
                queue.enqueue_many(
                    [{"n": n} for n in range(start, min(start + FILL_CHUNK, count))]
                )

    def analyze(self) -> None:
        """Fresh planner statistics for the items table (and, on PostgreSQL, the dead rows
        of earlier rounds gone), so that every round starts from the same kind of table."""
        dialect(self.connection).analyze(self.items())

    def forget_consumers(self, identities: list[str]) -> None:
        """Delete the Consumer rows the run's own consumers left behind."""
        store.delete_consumers(Consumer.objects.using(self.alias).filter(identity__in=identities))

    def strategies(self) -> list[str]:
        """The claim strategies this database runs."""
        found = ["update_limit"]
        if dialect(self.connection).supports_skip_locked(self.connection):
            found.insert(0, "skip_locked")
        return found
