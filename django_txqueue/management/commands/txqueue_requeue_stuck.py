"""``manage.py txqueue_requeue_stuck [QUEUE ...] [--database ALIAS]``."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from ...api import Queue
from ...models import QueueItem
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
        else:
            # Only the queues that have stuck items, each through Queue.requeue_stuck() so
            # that per-queue rescue settings apply exactly as they do for named queues.
            alias = default_alias(options["database"])
            stuck = QueueItem.objects.using(alias).stuck().order_by()
            names = sorted(set(stuck.values_list("queue", flat=True).distinct()))
            queues = [Queue(name, using=alias) for name in names]
        rescued = sum(queue.requeue_stuck() for queue in queues)
        self.stdout.write(self.style.SUCCESS(f"Rescued {rescued} stuck item(s)."))
