"""``manage.py txqueue_bench``: enqueue, drain, wake-up and backlog-scale figures on the
configured database, optionally beside a hand-written SQL queue (``--compare-raw``).
The workloads live in ``django_txqueue.contrib.bench``; this parses, checks and prints."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_txqueue.contrib.bench import drain, enqueue, fair, scale, spread, wakeup
from django_txqueue.contrib.bench.report import table
from django_txqueue.contrib.progress import Progress
from django_txqueue.contrib.target import Target
from django_txqueue.management import own_queue
from django_txqueue.observe.logs import counted

PARTS = ("enqueue", "drain", "wakeup", "scale", "spread", "fair")
# "spread" (one consumer serving many queues) and "fair" (fair and bounded queues against
# plain ones) run when asked for.
DEFAULT_PARTS = PARTS[:-2]
SAFE_WORDS = ("test", "bench", "staging")


class Command(BaseCommand):
    help = (
        "Benchmark the queue on a database: enqueue, drain, wake-up latency and backlog "
        "scale. Writes and deletes only items of its own queue (--queue)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--database", metavar="ALIAS", help="Database alias to measure.")
        parser.add_argument(
            "--queue",
            default="txqueue-bench",
            help="The queue name the bench writes, drains and deletes (default %(default)s).",
        )
        parser.add_argument(
            "--only",
            default=",".join(DEFAULT_PARTS),
            help=f"Comma-separated parts to run, of {','.join(PARTS)} "
            f"(default: {','.join(DEFAULT_PARTS)}).",
        )
        parser.add_argument(
            "--items", type=int, default=5000, help="Items per drain (default %(default)s)."
        )
        parser.add_argument(
            "--batch", type=int, nargs="+", default=[1, 10, 100], help="Claim sizes to drain with."
        )
        parser.add_argument(
            "--processes",
            type=int,
            nargs="+",
            default=[1],
            help="Consumer processes per drain; several (2 4 16) give a row each, side by "
            "side, with each rate as a share of the first's.",
        )
        parser.add_argument(
            "--drain-mode",
            choices=drain.MODES,
            default="process",
            help="Drain through run_queue_consumer processes, what users run (process, the "
            "default), or through the consumer's Worker in forked children of this "
            "command (inprocess: no start-up, the consumer's loop alone).",
        )
        parser.add_argument(
            "--strategy",
            choices=["skip_locked", "update_limit", "all"],
            default="all",
            help="Claim strategy to drain with (default: every one the database runs).",
        )
        parser.add_argument(
            "--enqueue-items",
            type=int,
            default=2000,
            help="Items enqueued one at a time, and (rounded to 1,000s) with enqueue_many.",
        )
        parser.add_argument(
            "--wakeup-items", type=int, default=200, help="Wake-up samples (20 ms apart)."
        )
        parser.add_argument(
            "--cold-starts",
            type=int,
            default=5,
            help="Consumers started to measure a wake-up in their first second.",
        )
        parser.add_argument(
            "--idle-seconds",
            type=float,
            default=5.0,
            help="Seconds over which the idle consumer's CPU is measured (0: not measured).",
        )
        parser.add_argument(
            "--scale-rows", type=int, default=1_000_000, help="The big backlog's rows."
        )
        parser.add_argument(
            "--scale-claims", type=int, default=3000, help="Items claimed per backlog."
        )
        parser.add_argument(
            "--compare-raw",
            action="store_true",
            help="Run a hand-written SQL queue on the same table too; print ours as %% of it.",
        )
        parser.add_argument("--json", action="store_true", help="Print one JSON document.")
        parser.add_argument(
            "--yes",
            action="store_true",
            help="Run on a database whose name has none of: test, bench, staging.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        alias, queue = own_queue(options["queue"], options["database"])
        parts = [part.strip() for part in options["only"].split(",") if part.strip()]
        unknown = sorted(set(parts) - set(PARTS))
        if unknown or not parts:
            raise CommandError(f"--only takes {', '.join(PARTS)}; not {', '.join(unknown)}")
        for name in ("items", "enqueue_items", "wakeup_items", "scale_rows"):
            if options[name] < 1:
                raise CommandError(f"--{name.replace('_', '-')} must be at least 1")
        if min(options["batch"]) < 1:
            raise CommandError("--batch sizes must be at least 1")
        if min(options["processes"]) < 1:
            raise CommandError("--processes must be at least 1")
        if "drain" in parts and options["drain_mode"] == "process" and not drain.settings_module():
            raise CommandError(drain.NO_SETTINGS_MODULE)
        target = Target(alias, queue)
        check_safe_name(target, options["yes"])
        strategies = target.strategies()
        if options["strategy"] != "all":
            if options["strategy"] not in strategies:
                raise CommandError(
                    f"{target.connection.display_name} has no {options['strategy']}; "
                    f"it runs {', '.join(strategies)}"
                )
            strategies = [options["strategy"]]

        began = time.monotonic()
        progress = Progress(None if options["json"] else self.stderr._out)  # type: ignore[arg-type]
        result = describe(target)
        result["settings"] = {
            key: options[key]
            for key in (
                "items",
                "batch",
                "processes",
                "drain_mode",
                "enqueue_items",
                "wakeup_items",
                "cold_starts",
                "idle_seconds",
                "scale_rows",
                "scale_claims",
                "compare_raw",
            )
        }
        result["settings"]["strategies"] = strategies
        problems: list[str] = []
        compare_raw = options["compare_raw"]
        try:
            if "enqueue" in parts:
                result["enqueue"] = enqueue.run(
                    target,
                    items=options["enqueue_items"],
                    compare_raw=compare_raw,
                    progress=progress,
                )
            if "drain" in parts:
                result["drain"] = drain.run(
                    target,
                    items=options["items"],
                    batches=options["batch"],
                    processes=options["processes"],
                    strategies=strategies,
                    compare_raw=compare_raw,
                    progress=progress,
                    mode=options["drain_mode"],
                )
                for row in result["drain"]:
                    shape = f"drain {row['strategy']} batch {row['batch']} x{row['processes']}"
                    problems += [f"{shape}: {problem}" for problem in row["problems"]]
            if "wakeup" in parts:
                try:
                    result["wakeup"] = wakeup.run(
                        target,
                        items=options["wakeup_items"],
                        cold_starts=options["cold_starts"],
                        idle_seconds=options["idle_seconds"],
                        compare_raw=compare_raw,
                        progress=progress,
                    )
                except wakeup.BenchError as exc:
                    problems.append(f"wake-up: {exc}")
            if "scale" in parts:
                result["scale"] = scale.run(
                    target,
                    scale_rows=options["scale_rows"],
                    claims=options["scale_claims"],
                    progress=progress,
                )
            if "spread" in parts:
                result["spread"] = spread.run(
                    target, items=options["items"], batches=options["batch"], progress=progress
                )
                for row in result["spread"]:
                    shape = f"spread {row['shape']} batch {row['batch']}"
                    problems += [f"{shape}: {problem}" for problem in row["problems"]]
            if "fair" in parts:
                result["fair"] = fair.run(
                    target,
                    scale_rows=options["scale_rows"],
                    claims=options["scale_claims"],
                    enqueue_items=options["enqueue_items"],
                    progress=progress,
                )
        finally:
            progress.close()
            target.clear()
        result["problems"] = problems
        result["ok"] = not problems
        result["seconds"] = time.monotonic() - began
        self.stdout.write(json.dumps(result, indent=2) if options["json"] else table(result))
        if problems:
            raise CommandError(
                f"verification failed: {counted(len(problems), 'problem')}, listed above"
            )


def check_safe_name(target: Target, yes: bool) -> None:
    """Refuse a database that does not look like a test, bench or staging one, unless
    told to run anyway."""
    name = target.database_name
    if yes or any(word in name.lower() for word in SAFE_WORDS):
        return
    raise CommandError(
        f"Refusing to benchmark database {name!r} (alias {target.alias!r}): its name has "
        f"none of {', '.join(SAFE_WORDS)}. The bench writes and deletes only items of queue "
        f"{target.queue!r}, but loads the server; pass --yes to run it anyway."
    )


def describe(target: Target) -> dict[str, Any]:
    """Where and on what the figures were taken."""
    version = target.connection.get_database_version()
    return {
        "database": {
            "alias": target.alias,
            "vendor": target.connection.display_name,
            "version": ".".join(str(part) for part in version),
            "name": target.database_name,
        },
        "queue": target.queue,
        "cpus": os.cpu_count(),
        "load_average": ", ".join(f"{n:.2f}" for n in os.getloadavg()),
    }
