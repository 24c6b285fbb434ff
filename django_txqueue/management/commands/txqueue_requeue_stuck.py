"""``manage.py txqueue_requeue_stuck [QUEUE ...] [--database ALIAS]``."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from ...api import queue_databases, requeue_all_stuck
from ...observe.logs import counted
from .. import add_queue_arguments, default_alias, selected_queues


class Command(BaseCommand):
    help = (
        "Rescue stuck items (lease expired or consumer dead): READY again, or FAILED when "
        "their attempts are spent (default: every queue)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        add_queue_arguments(parser, "rescue")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["queues"]:
            queues = selected_queues(options["queues"], options["database"])
            rescued = sum(queue.requeue_stuck() for queue in queues)
        else:
            database = options["database"]
            aliases = [default_alias(database)] if database else queue_databases()
            rescued = sum(requeue_all_stuck(alias) for alias in aliases)
        self.stdout.write(self.style.SUCCESS(f"Rescued {counted(rescued, 'stuck item')}."))
