"""``manage.py txqueue_stats [QUEUE ...] [--database ALIAS] [--json]``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from ...observe.logs import counted
from ...validation import parse_rate
from .. import add_queue_arguments, selected_queues

COLUMNS = (
    ("queue", "queue"),
    ("ready", "ready"),
    ("in_progress", "in progress"),
    ("waiting", "waiting"),
    ("done", "done"),
    ("failed", "failed"),
    ("cancelled", "cancelled"),
    ("stuck", "stuck"),
    ("oldest_ready_age_s", "oldest ready age (s)"),
)


class Command(BaseCommand):
    help = (
        "Show items per status, stuck items and the oldest due item's wait, per queue "
        "(default: every queue that has items or is configured in TXQUEUE['QUEUES'])."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        add_queue_arguments(parser, "show")
        parser.add_argument(
            "--json", action="store_true", help="Print a JSON list of Queue.stats() dicts."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        # The configured queues too: a new queue shows, with zeros, before its first item.
        queues = selected_queues(options["queues"], options["database"], configured=True)
        stats = [queue.stats() for queue in queues]
        if options["json"]:
            self.stdout.write(json.dumps(stats, indent=2))
        elif not stats:
            self.stdout.write("No queue items.")
        else:
            self.stdout.write(table(stats))
            if paused := [stat["queue"] for stat in stats if stat["paused"]]:
                self.stdout.write(f"Paused: {', '.join(paused)}")
            for stat in stats:
                if "max_in_flight" in stat:
                    self.stdout.write(
                        f"{stat['queue']}: {stat['in_progress']} in progress of "
                        f"MAX_IN_FLIGHT {stat['max_in_flight']}"
                    )
                for line in rate_lines(stat):
                    self.stdout.write(line)
                if "keys_waiting" in stat:
                    self.stdout.write(keys_line(stat))


def rate_lines(stat: dict[str, Any]) -> Iterator[str]:
    """A rate-limited queue's limits and their use, a line each (docs/limits.md)."""
    if rate := stat.get("rate_limit"):
        period = parse_rate(rate["limit"]).per.split()[-1]
        yield (
            f"{stat['queue']}: RATE_LIMIT {rate['limit']}, {rate['used']} used in the "
            f"last {period}"
        )
    if per_key := stat.get("rate_limit_per_key"):
        spent = per_key["keys_spent"]
        yield (
            f"{stat['queue']}: RATE_LIMIT_PER_KEY {per_key['limit']}, {counted(spent, 'key')} "
            "spent"
        )


def table(stats: list[dict[str, Any]]) -> str:
    """Plain aligned columns: the queue name left-aligned, numbers right-aligned."""
    rows = [[title for _, title in COLUMNS]]
    for stat in stats:
        cells = [str(stat[key]) for key, _ in COLUMNS[:-1]]
        rows.append([*cells, f"{stat['oldest_ready_age_s']:.1f}"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = []
    for row in rows:
        first = row[0].ljust(widths[0])
        rest = (cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True))
        lines.append("  ".join([first, *rest]))
    return "\n".join(lines)


def keys_line(stat: dict[str, Any]) -> str:
    """A fair or ordered queue's keys: how many have waiting items, and the busiest."""
    busiest = ", ".join(f"{key} ({count})" for key, count in stat["top_keys"])
    waiting = counted(stat["keys_waiting"], "key")
    return f"{stat['queue']}: {waiting} waiting; most waiting: {busiest or '-'}"
