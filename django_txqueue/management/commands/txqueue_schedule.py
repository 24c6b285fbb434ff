"""``manage.py txqueue_schedule``: the ``SCHEDULE`` entries and the enabled ``Schedule``
rows, with their last and next runs."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.core.management.base import BaseCommand
from django.utils import timezone

from ...schedule import every_entry, overview

TITLES = ("entry", "enqueues", "schedule", "last run", "next run")


class Command(BaseCommand):
    help = (
        "List TXQUEUE['SCHEDULE']'s entries and the enabled Schedule rows: what each "
        "enqueues, when, its last run (the latest tick enqueued) and its next run, in TIME_ZONE."
    )

    def handle(self, *args: Any, **options: Any) -> None:
        rows = overview(every_entry())
        if not rows:
            self.stdout.write(
                "No schedule entries (TXQUEUE['SCHEDULE'] is empty; no Schedule row is enabled)."
            )
            return
        cells = [list(TITLES)] + [
            [row.name, row.target, row.timing, shown(row.last_run, "never"), shown(row.next_run)]
            for row in rows
        ]
        widths = [max(len(line[i]) for line in cells) for i in range(len(TITLES))]
        for line in cells:
            padded = (cell.ljust(width) for cell, width in zip(line, widths, strict=True))
            self.stdout.write("  ".join(padded).rstrip())


def shown(moment: datetime | None, missing: str = "-") -> str:
    """A time in TIME_ZONE, to the second."""
    if moment is None:
        return missing
    return timezone.localtime(moment).isoformat(sep=" ", timespec="seconds")
