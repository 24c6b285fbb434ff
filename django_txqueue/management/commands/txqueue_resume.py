"""``manage.py txqueue_resume QUEUE [QUEUE ...] [--database ALIAS]``."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from .. import selected_queues


class Command(BaseCommand):
    help = "Resume paused queues: consumers claim their items again at once."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("queues", nargs="+", metavar="QUEUE", help="Queues to resume.")
        parser.add_argument("--database", metavar="ALIAS", help="Database alias of the queues.")

    def handle(self, *args: Any, **options: Any) -> None:
        for queue in selected_queues(options["queues"], options["database"]):
            if queue.resume():
                self.stdout.write(self.style.SUCCESS(f"Resumed queue {queue.name!r}."))
            else:
                self.stdout.write(f"Queue {queue.name!r} was not paused.")
