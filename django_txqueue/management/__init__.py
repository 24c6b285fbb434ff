"""Shared by the maintenance commands: picking the database and the queues to act on."""

from __future__ import annotations

from collections.abc import Sequence

from django.core.management.base import CommandError, CommandParser
from django.db import connections

from ..api import (
    Queue,
    configured_queues,
    default_database,
    items_database,
    queue_databases,
)
from ..models import QueueItem


def add_queue_arguments(parser: CommandParser, verb: str) -> None:
    """``QUEUE ...`` and ``--database ALIAS``, as every queue command takes them."""
    parser.add_argument("queues", nargs="*", metavar="QUEUE", help=f"Queues to {verb}.")
    parser.add_argument(
        "--database", metavar="ALIAS", help="Database alias holding the queue tables."
    )


def default_alias(database: str | None) -> str:
    """``--database``, checked; else the alias the queue tables live on by default."""
    if database is None:
        return default_database()
    if database not in connections:
        known = ", ".join(sorted(connections))
        raise CommandError(f"Unknown database alias {database!r}; DATABASES has: {known}.")
    return database


def own_queue(name: str, database: str | None) -> tuple[str, str]:
    """The alias and checked queue name of a command that works on a queue of its own
    (the optional apps' ``txqueue_bench`` and ``txqueue_chaos``): ``--database``, else
    where the queue is placed."""
    try:
        queue = Queue(name, using=database and default_alias(database))
    except (TypeError, ValueError) as exc:
        raise CommandError(str(exc)) from exc
    return queue.using, queue.name


def queue_home(name: str, database: str | None) -> str:
    """Where a consumer finds queue ``name``'s items: ``--database``, else where its
    handler's source keeps it (a Tasks backend's ``DATABASE``), else its home."""
    if database is not None:
        return default_alias(database)
    return items_database(name)


def queue_names(alias: str, *, configured: bool = False) -> list[str]:
    """Every queue that has items on ``alias``, sorted; with ``configured``, the queues
    ``TXQUEUE["QUEUES"]`` places there too, items or not."""
    names = QueueItem.objects.using(alias).order_by().values_list("queue", flat=True)
    return sorted(set(names.distinct()) | set(configured_queues(alias) if configured else ()))


def selected_queues(
    names: Sequence[str], database: str | None, *, configured: bool = False
) -> list[Queue]:
    """The queues named (each on ``--database``, else where it is placed), or, with no
    names, every queue that has items on ``--database`` (or on any database the
    settings place queues on), and with ``configured`` those configured there too."""
    if not names:
        aliases = [default_alias(database)] if database else queue_databases()
        return [
            Queue(name, using=alias)
            for alias in aliases
            for name in queue_names(alias, configured=configured)
        ]
    try:
        return [Queue(name, using=queue_home(name, database)) for name in dict.fromkeys(names)]
    except (TypeError, ValueError) as exc:
        raise CommandError(str(exc)) from exc
