"""``manage.py txqueue_cancel QUEUE (--id ID [ID ...] | --all) [--database ALIAS]``."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from ...api import Queue
from ...observe.logs import counted
from .. import queue_home


class Command(BaseCommand):
    help = (
        "Cancel items of a queue: READY ones end CANCELLED at once, running ones are asked "
        "to stop (their handlers poll cancel_requested()). Name the items with --id, or "
        "pass --all to cancel every unfinished item of the queue."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("queue", metavar="QUEUE", help="The queue whose items to cancel.")
        which = parser.add_mutually_exclusive_group(required=True)
        which.add_argument(
            "--id",
            dest="ids",
            type=int,
            nargs="+",
            action="extend",
            metavar="ID",
            help="Ids of the items to cancel (items of other queues are left alone).",
        )
        which.add_argument(
            "--all",
            action="store_true",
            help="Cancel every unfinished item of the queue.",
        )
        parser.add_argument(
            "--database", metavar="ALIAS", help="Database alias holding the queue tables."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            queue = Queue(
                options["queue"], using=queue_home(options["queue"], options["database"])
            )
        except (TypeError, ValueError) as exc:
            raise CommandError(str(exc)) from exc
        ids: list[int] | None = options["ids"]
        chosen = None if ids is None else queue.items.filter(pk__in=ids)
        cancelled = queue.cancel(chosen)
        # A running item counts as cancelled once asked to stop; it ends so when it does.
        self.stdout.write(
            self.style.SUCCESS(f"Cancelled {counted(cancelled, 'item')} of {queue.name}.")
        )
