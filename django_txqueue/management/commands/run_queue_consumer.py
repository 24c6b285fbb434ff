"""``run_queue_consumer [QUEUE ...]``: arguments in, ``Worker(...).run()``, progress out."""

from __future__ import annotations

import logging
import math
import sys
import threading
from argparse import SUPPRESS
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from ... import conf
from ...consumer import registry
from ...consumer.readiness import NotMigrated, wait_for_database
from ...consumer.recycling import Recycling, tell_supervisor
from ...consumer.stopping import StopSignals
from ...consumer.supervisor import Supervisor, child_argv
from ...consumer.worker import BURST_WAIT, Progress, Worker
from ...observe import metrics
from .. import default_alias, queue_home


def positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise ValueError(value)
    return number


def positive_seconds(value: str) -> float:
    """A finite number of seconds above 0 (argparse names the option when it is not)."""
    number = float(value)
    if not (math.isfinite(number) and number > 0):
        raise ValueError(value)
    return number


def port(value: str) -> int:
    number = int(value)
    if not 1 <= number <= 65535:
        raise ValueError(value)
    return number


def without_metrics_options(argv: list[str]) -> list[str]:
    """A child's command line: the supervisor serves the metrics; the children record
    them (``--metrics-child``)."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--metrics-port", "--metrics-address"):
            skip = True
        elif not arg.startswith(("--metrics-port=", "--metrics-address=")):
            kept.append(arg)
    return [*kept, "--metrics-child"]


def placement(
    names: list[str], database: str | None, *, discovering: bool
) -> dict[str, list[str]]:
    """``{alias: [queue, ...]}``: every queue on ``--database``, else each where it lives
    (``queue_home``); a consumer that finds queues as they come also looks on the
    databases of the default and of the Tasks backends."""
    placed: dict[str, list[str]] = {default_alias(database): []} if database else {}
    for name in names:
        placed.setdefault(queue_home(name, database), []).append(name)
    if discovering and not database:
        for alias in [default_alias(None), *registry.databases()]:
            placed.setdefault(alias, [])
    return placed


def recycling(options: dict[str, Any]) -> Recycling | None:
    """``--max-items``, ``--max-memory`` and ``--max-age``, if any is given."""
    limits = Recycling(options["max_items"], options["max_memory"], options["max_age"])
    return None if limits == Recycling() else limits


class Command(BaseCommand):
    help = (
        "Consume queues: run their handlers until stopped (SIGTERM/SIGINT/SIGHUP: graceful). "
        "Without names, every queue that has a handler, plus the Django Tasks queues."
    )
    # Django's checks need the database (the server's version): handle() runs them once
    # it has waited for the database, instead of dying before it if it is down.
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("queues", nargs="*", metavar="QUEUE")
        parser.add_argument(
            "--burst", action="store_true", help="Exit 0 as soon as nothing is due."
        )
        parser.add_argument(
            "--burst-wait",
            type=positive_seconds,
            default=BURST_WAIT,
            metavar="SECONDS",
            help="With --burst: exit 1 once a database has not answered for SECONDS "
            f"(default {BURST_WAIT:g}), at start or later, instead of waiting for it forever.",
        )
        parser.add_argument(
            "--concurrency",
            type=positive_int,
            default=1,
            help="Handlers at once: threads, or coroutines for async ones (default 1: on "
            "the consumer's own thread, watched).",
        )
        parser.add_argument(
            "--batch", type=positive_int, help="Items per claim (default: --concurrency)."
        )
        parser.add_argument(
            "--strategy", choices=conf.STRATEGIES, default="auto", help="Claim strategy."
        )
        parser.add_argument(
            "--lease",
            type=positive_seconds,
            help="Lease in seconds (default: TXQUEUE LEASE per queue).",
        )
        parser.add_argument("--database", help="Database alias of the queue tables.")
        parser.add_argument(
            "--processes",
            type=positive_int,
            default=1,
            help="Run N consumer processes under a supervisor that restarts dead ones.",
        )
        parser.add_argument(
            "--shutdown-timeout",
            type=positive_seconds,
            help="Seconds in-flight handlers get to finish on SIGTERM (default: TXQUEUE).",
        )
        parser.add_argument("--skip-checks", action="store_true", help="Skip system checks.")
        parser.add_argument(
            "--metrics-port",
            type=port,
            help="Serve Prometheus metrics over HTTP on this port (the prometheus extra).",
        )
        parser.add_argument(
            "--metrics-address",
            default="0.0.0.0",  # noqa: S104 - scraped from another host or pod, as usual
            help="Address the metrics endpoint listens on (default 0.0.0.0: every interface).",
        )
        parser.add_argument(
            "--max-items",
            type=positive_int,
            help="Recycle: claim N items, run them, exit 0 (replaced under --processes).",
        )
        parser.add_argument(
            "--max-memory",
            type=positive_seconds,
            metavar="MB",
            help="Recycle once the process's resident memory reaches MB megabytes.",
        )
        parser.add_argument(
            "--max-age",
            type=positive_seconds,
            metavar="SECONDS",
            help="Recycle once the process has run SECONDS seconds.",
        )
        # Given by the supervisor to its children: record metrics for it to serve.
        parser.add_argument("--metrics-child", action="store_true", help=SUPPRESS)

    def handle(self, *args: Any, **options: Any) -> None:
        registry.autodiscover()
        known = registry.handlers()
        names: list[str] = options["queues"] or sorted(known)
        unknown = [name for name in names if name not in known]
        # With no names, Tasks of a backend that takes any queue name are found as they come.
        discover = None if options["queues"] else registry.find
        if unknown or not (names or registry.takes_any_queue()):
            problem = (
                f"No handler for queue {', '.join(map(repr, unknown))}."
                if unknown
                else "No queues to consume: register a @handler in an app's queues.py, "
                "or configure the Django Tasks backend."
            )
            raise CommandError(f"{problem} Known queues: {', '.join(sorted(known)) or 'none'}.")
        placed = placement(names, options["database"], discovering=discover is not None)
        self.configure_logging(options["verbosity"])
        if options["metrics_port"] is not None or options["metrics_child"]:
            try:
                metrics.prometheus()
            except metrics.MetricsUnavailable as exc:
                raise CommandError(f"--metrics-port: {exc}") from exc
        worker, signals = None, StopSignals()
        if options["processes"] == 1:
            worker = Worker(
                handlers={name: known[name] for name in names},
                using=placed,
                concurrency=options["concurrency"],
                batch=options["batch"],
                strategy=options["strategy"],
                lease=options["lease"],
                burst=options["burst"],
                shutdown_timeout=options["shutdown_timeout"],
                discover=discover,
                on_progress=self.show_progress if options["verbosity"] >= 1 else None,
                recycling=recycling(options),
                burst_wait=options["burst_wait"],
                signals=signals,
            )
        # Signals stop the wait for the database too (the supervisor installs its own after).
        stopping = threading.Event() if worker is None else worker.stopping
        signals.install(stopping.set if worker is None else worker.stop)
        burst_wait = options["burst_wait"] if options["burst"] else None
        ready = self.ready(
            list(placed), stopping, skip_checks=options["skip_checks"], burst_wait=burst_wait
        )
        if not ready:
            return  # stopped while waiting for the database: exit 0
        if worker is not None:
            self.start_metrics(options)
            code = worker.run()
            if worker.recycled is not None:  # logged by the worker
                tell_supervisor(worker.recycled)
        else:
            code = 0 if stopping.is_set() else self.supervise(options)
        if code:
            sys.exit(code)

    def start_metrics(self, options: dict[str, Any]) -> None:
        """``--metrics-port`` (or, in a child of ``--processes``, ``--metrics-child``)."""
        if options["metrics_child"]:
            from ...observe.exposition import record_as_child

            record_as_child()
        elif options["metrics_port"] is not None:
            from ...observe.exposition import serve_this_process

            try:
                serve_this_process(options["metrics_port"], options["metrics_address"])
            except OSError as exc:
                raise CommandError(f"--metrics-port {options['metrics_port']}: {exc}") from exc

    def supervise(self, options: dict[str, Any]) -> int:
        """``--processes N``: the supervisor, serving its children's metrics if asked."""
        if options["metrics_port"] is None:
            return Supervisor(child_argv(), options["processes"]).run()
        from ...observe.exposition import Multiprocess

        served = Multiprocess()
        try:
            served.start(options["metrics_port"], options["metrics_address"])
        except OSError as exc:
            served.close()
            raise CommandError(f"--metrics-port {options['metrics_port']}: {exc}") from exc
        try:
            return Supervisor(without_metrics_options(child_argv()), options["processes"]).run()
        finally:
            served.close()

    def ready(
        self,
        aliases: list[str],
        stopping: threading.Event,
        *,
        skip_checks: bool,
        burst_wait: float | None,
    ) -> bool:
        """Wait for each database (False: stopped meanwhile; past ``burst_wait`` seconds,
        a ``--burst`` run's, an error), then check that it is migrated and run the system
        checks, raising what they find."""
        for using in aliases:
            try:
                answered = wait_for_database(using, stopping, within=burst_wait)
            except NotMigrated as exc:
                raise CommandError(str(exc)) from exc
            if not answered:
                if stopping.is_set():
                    return False
                raise CommandError(
                    f"Database {using!r} did not answer for {burst_wait:g} s (--burst-wait): "
                    "a --burst run gives up."
                )
        if not skip_checks:
            self.check()
        return True

    def show_progress(self, progress: Progress) -> None:
        line = (
            f"processed {progress.processed}  failed {progress.failed}  "
            f"{progress.rate:.1f}/s  backlog {progress.backlog_text}  "
            f"in flight {progress.in_flight}"
        )
        if self.stdout.isatty():
            self.stdout.write(f"\r{line}\033[K", ending="")
            self.stdout.flush()
        else:
            self.stdout.write(line)

    def configure_logging(self, verbosity: int) -> None:
        """-v 2 shows the consumer's INFO log, -v 3 its DEBUG log, unless LOGGING has it."""
        logger = logging.getLogger("django_txqueue")
        if verbosity >= 2 and not logger.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
            logger.addHandler(handler)
            logger.setLevel(logging.DEBUG if verbosity >= 3 else logging.INFO)
