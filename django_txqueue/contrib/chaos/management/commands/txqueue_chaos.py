"""``manage.py txqueue_chaos``: kill, stop and restart under a drain, then audit it."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_txqueue.contrib.chaos.run import Options, RestartFailed, run
from django_txqueue.contrib.progress import Progress
from django_txqueue.contrib.target import Target
from django_txqueue.management import own_queue
from django_txqueue.observe.logs import counted
from django_txqueue.validation import parse_rate

SAFE_WORDS = ("test", "staging")


class Command(BaseCommand):
    help = (
        "Drain items through consumer processes while killing, stopping and (with "
        "--restart-command) restarting the database; then check that none was lost, none "
        "completed under two claims, and stale copies changed nothing. Writes and deletes "
        "only its own queue's items."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--database", metavar="ALIAS", help="Database alias to run on.")
        parser.add_argument("--queue", default="txqueue-chaos", help="Its own queue's name.")
        parser.add_argument("--items", type=int, default=2000, help="Items (default 2000).")
        parser.add_argument("--consumers", type=int, default=4, help="Consumer processes.")
        parser.add_argument("--rounds", type=int, default=5, help="Rounds of faults.")
        parser.add_argument(
            "--lease", type=float, default=3.0, help="The consumers' lease, seconds."
        )
        parser.add_argument("--seed", type=int, default=0, help="Seed of the fault schedule.")
        parser.add_argument(
            "--restart-command",
            help="A command that restarts the database server, run once per round.",
        )
        parser.add_argument(
            "--flows",
            action="store_true",
            help="Enqueue the items as flows: groups of 100 steps, each with a then "
            "(docs/flows.md), and check that no then ran before its steps.",
        )
        parser.add_argument(
            "--rate-limit",
            metavar="RATE",
            help="Give the queue a RATE_LIMIT ('200/s'; docs/limits.md) and check that the "
            "handlers never started more than it allows.",
        )
        parser.add_argument("--json", action="store_true", help="Print one JSON document.")
        parser.add_argument(
            "--yes",
            action="store_true",
            help="Run on a database whose name has neither 'test' nor 'staging'.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        alias, queue = own_queue(options["queue"], options["database"])
        for name in ("items", "consumers", "rounds"):
            if options[name] < 1:
                raise CommandError(f"--{name} must be at least 1")
        if options["consumers"] < 2:
            raise CommandError("--consumers must be at least 2: one is killed, one stopped")
        if not options["lease"] > 0:
            raise CommandError("--lease must be a positive number of seconds")
        if options["rate_limit"] is not None:
            try:
                parse_rate(options["rate_limit"])
            except ValueError as exc:
                raise CommandError(f"--rate-limit: {exc}") from exc
        name = Target(alias, queue).database_name
        if not options["yes"] and not any(word in name.lower() for word in SAFE_WORDS):
            raise CommandError(
                f"Refusing to run on database {name!r}: its name has neither 'test' nor "
                "'staging'. It writes and deletes only its own queue's items, but kills "
                "processes and may restart the server; pass --yes to run it anyway."
            )
        progress = Progress(None if options["json"] else self.stderr._out)  # type: ignore[arg-type]
        try:
            report = run(
                Options(
                    alias=alias,
                    queue=queue,
                    items=options["items"],
                    consumers=options["consumers"],
                    rounds=options["rounds"],
                    lease=options["lease"],
                    seed=options["seed"],
                    restart_command=options["restart_command"],
                    verbose=options["verbosity"] > 1,
                    flows=options["flows"],
                    rate_limit=options["rate_limit"],
                ),
                progress.phase,
            )
        except RestartFailed as exc:
            raise CommandError(str(exc)) from exc
        finally:
            progress.close()
        self.stdout.write(
            json.dumps(report, indent=2, default=str) if options["json"] else text(report)
        )
        if report["violations"]:
            raise CommandError(f"{counted(len(report['violations']), 'violation')}, listed above")


def text(report: dict[str, Any]) -> str:
    lines = [
        f"{report['items']:,} items, {report['rounds']} rounds: {report['kills']} killed, "
        f"{report['sigterms']} stopped by SIGTERM, {report['restarts']} database restarts "
        f"({report['seconds']:.0f} s)",
        f"runs: {report['runs']:,}; duplicates: {report['duplicates']} "
        f"({report['duplicates_explained']} by a killed consumer or a restart)",
        f"{report['orphans']} items held by killed consumers; longest rescue after a kill: "
        f"{report['max_rescue_s']:.1f} s "
        f"(bound {report['rescue_bound_s']:.1f} s)",
    ]
    if report["flows"]:
        lines.append(
            f"{report['flows']} flows: {report['released_early']} then items ran before "
            "their last step"
        )
    if report["rate_limit"]:
        lines.append(
            f"RATE_LIMIT {report['rate_limit']}: at most {report['most_started_in_a_period']} "
            f"handlers started in any {report['rate_window_s']:g} s"
        )
    if report["violations"]:
        lines += ["VIOLATIONS:", *(f"- {violation}" for violation in report["violations"])]
    else:
        lines.append("no violations: nothing lost, nothing completed twice, stale copies inert")
    return "\n".join(lines)
