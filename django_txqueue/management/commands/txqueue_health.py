"""``manage.py txqueue_health [--database ALIAS ...] [--max-heartbeat-age S [--consumer-pid
PID | --any-host]] [--max-ready-age S [--queue NAME ...]] [--json]``: a probe for
Kubernetes' exec probes and systemd. Exit status 0 and "ok: ..." when healthy, 1 and
"unhealthy: ..." (one line, every failing check's reason) when not."""

from __future__ import annotations

import json
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from ...observe import health
from .. import default_alias


def seconds(value: str) -> float:
    number = float(value)
    if not 0 <= number <= 10**7:
        raise ValueError(value)
    return number


class Command(BaseCommand):
    help = (
        "Exit 0 if the queue is healthy, else 1; prints one line saying why. Always checks "
        "that the databases answer and are migrated; the options add the other checks."
    )
    requires_system_checks: list[str] = []  # a probe runs often: a few queries, no more

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--database",
            metavar="ALIAS",
            action="append",
            default=[],
            help="Check this database (repeatable; default: every database the settings "
            "place queues on).",
        )
        parser.add_argument(
            "--max-heartbeat-age",
            type=seconds,
            metavar="SECONDS",
            help="Unhealthy unless this host runs a consumer and every one of them has "
            "heartbeat within SECONDS.",
        )
        who = parser.add_mutually_exclusive_group()
        who.add_argument(
            "--consumer-pid",
            type=int,
            metavar="PID",
            help="With --max-heartbeat-age: only the consumer with this OS pid.",
        )
        who.add_argument(
            "--any-host",
            action="store_true",
            help="With --max-heartbeat-age: healthy if any consumer, on any host, has "
            "heartbeat within SECONDS.",
        )
        parser.add_argument(
            "--max-ready-age",
            type=seconds,
            metavar="SECONDS",
            help="Unhealthy if a queue's oldest due item has waited longer than SECONDS "
            "(paused queues are left out).",
        )
        parser.add_argument(
            "--queue",
            metavar="NAME",
            action="append",
            default=[],
            help="With --max-ready-age: only this queue (repeatable; default: every queue).",
        )
        parser.add_argument(
            "--json", action="store_true", help="Print the JSON view's body instead."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["max_heartbeat_age"] is None and (
            options["consumer_pid"] is not None or options["any_host"]
        ):
            raise CommandError("--consumer-pid and --any-host need --max-heartbeat-age.")
        if options["queue"] and options["max_ready_age"] is None:
            raise CommandError("--queue needs --max-ready-age.")
        checks = health.run(
            databases=[default_alias(alias) for alias in options["database"]],
            max_heartbeat_age=options["max_heartbeat_age"],
            any_host=options["any_host"],
            consumer_pid=options["consumer_pid"],
            max_ready_age=options["max_ready_age"],
            queues=options["queue"],
        )
        if options["json"]:
            self.stdout.write(json.dumps(health.report(checks)))
        else:
            self.stdout.write(health.summary(checks))
        if not all(check.healthy for check in checks):
            sys.exit(1)
