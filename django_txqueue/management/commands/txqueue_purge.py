"""``manage.py txqueue_purge --older-than DAYS [QUEUE ...] [--database ALIAS]``."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from ... import store
from ...models import Effect
from ...observe.logs import counted
from .. import add_queue_arguments, default_alias, selected_queues

# A century: beyond any real retention, and within every vendor's date arithmetic.
MAX_DAYS = 36500


class Command(BaseCommand):
    help = (
        "Delete DONE and FAILED items finished more than DAYS days ago, in small batches "
        "(default: every queue, and the once() records made before then)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        add_queue_arguments(parser, "purge")
        parser.add_argument(
            "--older-than",
            type=float,
            required=True,
            metavar="DAYS",
            help="Age in days (a fraction is fine, 0 means every finished item).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        days: float = options["older_than"]
        if not (math.isfinite(days) and 0 <= days <= MAX_DAYS):
            raise CommandError(
                f"--older-than must be a number of days from 0 to {MAX_DAYS}, got {days:g}."
            )
        older_than = timedelta(days=days)
        queues = selected_queues(options["queues"], options["database"])
        deleted = sum(queue.purge(older_than=older_than) for queue in queues)
        self.stdout.write(
            self.style.SUCCESS(
                f"Deleted {counted(deleted, 'finished item')} older than {days:g} days."
            )
        )
        if not options["queues"]:  # the records are not per queue: only a full purge
            alias = default_alias(options["database"])
            effects = store.purge_effects(Effect.objects.using(alias), older_than)
            self.stdout.write(
                self.style.SUCCESS(
                    f"Deleted {counted(effects, 'once() record')} older than {days:g} days."
                )
            )
