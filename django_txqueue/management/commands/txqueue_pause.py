"""``manage.py txqueue_pause QUEUE [QUEUE ...] [--database ALIAS]``."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from .. import selected_queues


class Command(BaseCommand):
    help = (
        "Pause queues: no consumer claims their items until txqueue_resume. Items in "
        "flight finish; producers go on enqueueing."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("queues", nargs="+", metavar="QUEUE", help="Queues to pause.")
        parser.add_argument("--database", metavar="ALIAS", help="Database alias of the queues.")

    def handle(self, *args: Any, **options: Any) -> None:
        for queue in selected_queues(options["queues"], options["database"]):
            if queue.pause():
                self.stdout.write(self.style.SUCCESS(f"Paused queue {queue.name!r}."))
            else:
                self.stdout.write(f"Queue {queue.name!r} was paused already.")
