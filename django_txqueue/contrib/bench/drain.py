"""Drain: N no-op items, W consumer processes, batch B, each claim strategy; our
consumer beside the hand-written loop, and every drain checked for exactly-once
processing.

Ours drains through real ``run_queue_consumer QUEUE --burst --concurrency 1`` processes,
what users run (``--drain-mode process``, the default), or through ``Worker`` in forked
children of the bench (``inprocess``: no interpreter or Django start-up, the consumer's
own loop alone). The hand-written loop always runs in forked children.

Every consumer process claims its first batch, then waits at a start line (``gate``);
the clock starts when all have arrived and it opens, and stops at the last item's
``finished_at``: both read from the database's clock, so the rate is the steady one from
the first handler start to the last acknowledgement, and no start-up is timed.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from django.conf import settings
from django.db import connections
from django.db.models import Count, Max, QuerySet
from django.db.models.functions import Now

from django_txqueue import Consumer, QueueItem, Status

from ...observe.logs import counted
from ..progress import Progress
from ..target import Target
from .gate import GATE_VARIABLE, QUEUE_VARIABLE, Gate, at_first_call
from .raw import RawQueue
from .report import percent

CHILD_TIMEOUT = 600.0  # seconds a drain may take before the bench gives up on it
START_TIMEOUT = 120.0  # seconds the consumers may take to reach the start line
MODES = ("process", "inprocess")


def handle(item: QueueItem) -> None:
    """The benchmark's handler: no work, so the figure is the queue's own cost."""


@dataclass
class Drained:
    """One drain: items per second over first start to last finish, and what was wrong."""

    rate: float
    processed: int
    problems: list[str] = field(default_factory=list)


def verify_exactly_once(
    target: Target, expected: int, processed: int, items: QuerySet[QueueItem] | None = None
) -> list[str]:
    """Every item of the queue (or of ``items``) DONE after exactly one attempt,
    ``expected`` of them, and the consumers' own count agreeing: else one sentence per
    kind of violation."""
    problems = []
    rows = target.items() if items is None else items
    counts = rows.order_by().values_list("status", "attempts").annotate(n=Count("pk"))
    total = 0
    for status, attempts, n in counts:
        total += n
        if (status, attempts) != (Status.DONE, 1):
            label = Status(status).label
            problems.append(
                f"{counted(n, 'item')} {label} after {counted(attempts, 'attempt')}, "
                "not done after 1"
            )
    if total != expected:
        problems.append(f"{total} items in the queue where {expected} were enqueued")
    if processed != expected:
        problems.append(f"the consumers processed {processed} items, not {expected}")
    return problems


# -- consumers in forked children ------------------------------------------------------


def consume_with_worker(target: Target, batch: int, strategy: str, gate: Gate) -> tuple[int, str]:
    from django_txqueue.consumer.stopping import StopSignals
    from django_txqueue.consumer.worker import Worker

    worker = Worker(
        # ``handle`` looked up at each call: a test may replace it before the fork.
        handlers={target.queue: at_first_call(gate, lambda item: handle(item))},
        using=target.alias,
        batch=batch,
        strategy=strategy,
        burst=True,
        signals=StopSignals(),  # the child is the consumer's own, as under the command
    )
    worker.run()
    return worker.processed, worker.identity


def consume_by_hand(target: Target, batch: int, strategy: str, gate: Gate) -> tuple[int, str]:
    raw = RawQueue(target)
    try:
        return raw.drain(batch, strategy, ready=gate.arrive), ""
    finally:
        raw.close()


Consume = Callable[[Target, int, str, Gate], tuple[int, str]]


def child(
    consume: Consume, target: Target, batch: int, strategy: str, gate: Gate, results: Any
) -> None:
    """One forked consumer: drain, report how it went."""
    try:
        processed, identity = consume(target, batch, strategy, gate)
    except Exception as exc:  # reported, so that the parent neither hangs nor hides it
        results.put(("error", f"{type(exc).__name__}: {exc}"))
    else:
        results.put(("ok", processed, identity))
    finally:
        connections.close_all()


class Consumers(Protocol):
    """A drain's consumer processes, started."""

    def pids(self) -> list[int | None]: ...
    def running(self) -> list[bool]: ...
    def collect(self) -> None: ...
    def kill(self) -> None: ...
    def finish(self, target: Target) -> tuple[int, list[str], list[str]]:
        """(items processed, their Consumer identities, problems), once all have exited."""
        ...


class Forked:
    """Forked children of the bench, each running ``consume``."""

    def __init__(
        self,
        consume: Consume,
        target: Target,
        batch: int,
        strategy: str,
        processes: int,
        gate: Gate,
    ) -> None:
        context = multiprocessing.get_context("fork")
        self.results = context.Queue()
        self.reports: list[tuple[Any, ...]] = []
        self.children = [
            context.Process(
                target=child, args=(consume, target, batch, strategy, gate, self.results)
            )
            for _ in range(processes)
        ]
        for process in self.children:
            process.start()

    def pids(self) -> list[int | None]:
        return [process.pid for process in self.children]

    def running(self) -> list[bool]:
        return [process.is_alive() for process in self.children]

    def collect(self) -> None:
        while not self.results.empty():
            self.reports.append(self.results.get())

    def kill(self) -> None:
        for process in self.children:
            process.kill()

    def finish(self, target: Target) -> tuple[int, list[str], list[str]]:
        for process in self.children:
            process.join()
        self.collect()
        finished = [report for report in self.reports if report[0] == "ok"]
        problems = [f"a consumer failed: {r[1]}" for r in self.reports if r[0] == "error"]
        if len(self.reports) < len(self.children):
            missing = len(self.children) - len(self.reports)
            problems.append(f"{counted(missing, 'consumer')} died or timed out unreported")
        identities = [report[2] for report in finished if report[2]]
        return sum(report[1] for report in finished), identities, problems


def consumer_argv(target: Target, batch: int, strategy: str) -> list[str]:
    """The consumer's command line: ``python -m django`` (as ``manage.py``, which need
    not be where the bench was started from), with the bench's settings (``env``)."""
    return [
        sys.executable, "-m", "django", "run_queue_consumer", target.queue,
        "--burst", "--concurrency", "1", "--batch", str(batch), "--strategy", strategy,
        "--database", target.alias,
    ]  # fmt: skip


NO_SETTINGS_MODULE = (
    "--drain-mode process starts run_queue_consumer processes, which need the settings "
    "module by name (DJANGO_SETTINGS_MODULE; not settings.configure()): use --drain-mode "
    "inprocess"
)


def settings_module() -> str | None:
    """The settings' module, by which a consumer process loads the same settings."""
    return settings.SETTINGS_MODULE or os.environ.get("DJANGO_SETTINGS_MODULE") or None


def consumer_env(target: Target, gate: Gate) -> dict[str, str]:
    """This process's environment, its settings module and import path (so that the
    consumer opens the same database through the same code), the bench queue's name
    (for its no-op handler: ``queues.py``) and the start line."""
    module = settings_module()
    if not module:
        raise RuntimeError(NO_SETTINGS_MODULE)
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": module,
        "PYTHONPATH": os.pathsep.join(path for path in sys.path if path),
        QUEUE_VARIABLE: target.queue,
        GATE_VARIABLE: str(gate.path),
    }


class Spawned:
    """``run_queue_consumer`` processes, as users run them."""

    def __init__(
        self, target: Target, batch: int, strategy: str, processes: int, gate: Gate
    ) -> None:
        self.gate = gate
        consumers = Consumer.objects.using(target.alias)
        self.after = consumers.aggregate(last=Max("pk"))["last"] or 0
        argv, env = consumer_argv(target, batch, strategy), consumer_env(target, gate)
        self.processes = []
        for n in range(processes):
            with open(gate.path / f"stderr.{n}", "wb") as stderr:
                self.processes.append(
                    subprocess.Popen(  # noqa: S603 - our own interpreter and command
                        argv,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.DEVNULL,
                        stderr=stderr,
                    )  # fmt: skip
                )

    def pids(self) -> list[int | None]:
        return [process.pid for process in self.processes]

    def running(self) -> list[bool]:
        return [process.poll() is None for process in self.processes]

    def collect(self) -> None:
        pass  # they report through their Consumer rows

    def kill(self) -> None:
        for process in self.processes:
            process.kill()

    def finish(self, target: Target) -> tuple[int, list[str], list[str]]:
        problems = []
        for n, process in enumerate(self.processes):
            if code := process.wait():
                lines = (self.gate.path / f"stderr.{n}").read_text(errors="replace").split("\n")
                said = " | ".join(line for line in lines[-6:] if line.strip())
                problems.append(f"run_queue_consumer exited with {code}: {said}")
        rows = Consumer.objects.using(target.alias).filter(
            pk__gt=self.after, os_pid__in=[process.pid for process in self.processes]
        )
        found = list(rows.values_list("identity", "processed"))
        if len(found) < len(self.processes):
            problems.append(
                f"{len(self.processes) - len(found)} run_queue_consumer process(es) left no "
                "Consumer row here: do they open the bench's database (settings, --database)?"
            )
        return (
            sum(processed for _, processed in found),
            [identity for identity, _ in found],
            problems,
        )


# -- one drain ---------------------------------------------------------------------------


def database_now(target: Target) -> datetime | None:
    """The database's clock, as the items' ``finished_at`` reads it (None: no items)."""
    now = target.items().order_by().annotate(now=Now()).values_list("now", flat=True)[:1]
    return next(iter(now), None)


def wait(
    consumers: Consumers, until: Callable[[], bool], seconds: float, tick: Callable[[], None]
) -> bool:
    """Until ``until()`` or ``seconds``; False on time-out."""
    deadline = time.monotonic() + seconds
    last_tick = 0.0
    while not until():
        consumers.collect()  # a child blocks on exit until its report is read
        if time.monotonic() > deadline:
            return False
        if time.monotonic() - last_tick > 0.5:
            tick()
            last_tick = time.monotonic()
        time.sleep(0.002)
    return True


def drain_once(
    target: Target,
    start: Callable[[Gate], Consumers],
    *,
    items: int,
    processes: int,
    progress: Progress,
    label: str,
) -> Drained:
    """Fill ``items``, drain them with ``processes`` consumers (``start``), verify."""
    target.clear()
    target.fill(items)
    target.analyze()
    connections.close_all()  # each forked consumer opens its own
    gate = Gate()
    problems: list[str] = []
    opened, processed, identities = None, 0, list[str]()
    try:
        consumers = start(gate)

        def at_the_line() -> bool:
            states = zip(consumers.pids(), consumers.running(), strict=True)
            return all(gate.arrived(pid) or not running for pid, running in states)

        def arriving() -> None:
            come = sum(gate.arrived(pid) for pid in consumers.pids())
            progress.tick(f"{label}: {come}/{processes} consumers at the start line")

        if not wait(consumers, at_the_line, START_TIMEOUT, arriving):
            problems.append(f"not every consumer reached the start line in {START_TIMEOUT:.0f} s")
        opened = database_now(target)  # before the gate opens: no item is finished yet
        gate.open()
        began = time.monotonic()

        def draining() -> None:
            if progress.live:
                done = target.items().filter(status=Status.DONE).count()
                rate = done / (time.monotonic() - began)
                progress.tick(f"{label}: {done:,}/{items:,} items, {rate:,.0f}/s")

        if not wait(consumers, lambda: not any(consumers.running()), CHILD_TIMEOUT, draining):
            consumers.kill()
        processed, identities, failures = consumers.finish(target)
    finally:
        gate.remove()
    target.forget_consumers(identities)
    problems += failures + verify_exactly_once(target, items, processed)
    last = target.items().aggregate(last=Max("finished_at"))["last"]
    rate = 0.0
    if opened is not None and last is not None and last > opened:
        rate = processed / (last - opened).total_seconds()
    target.clear()
    return Drained(rate, processed, problems)


def starter(
    target: Target, batch: int, strategy: str, processes: int, mode: str
) -> Callable[[Gate], Consumers]:
    """How a drain's consumers start: ours as ``run_queue_consumer`` processes
    (``process``) or forked ``Worker``s (``inprocess``); the hand-written loop forked."""
    if mode == "process":
        return lambda gate: Spawned(target, batch, strategy, processes, gate)
    consume = consume_by_hand if mode == "by hand" else consume_with_worker
    return lambda gate: Forked(consume, target, batch, strategy, processes, gate)


def run(
    target: Target,
    *,
    items: int,
    batches: list[int],
    processes: list[int],
    strategies: list[str],
    compare_raw: bool,
    progress: Progress,
    mode: str = "process",
) -> list[dict[str, Any]]:
    """Every strategy, batch size and process count: the hand-written loop first, then
    ours; each rate also as a share of the first process count's."""
    rows = []
    for strategy in strategies:
        for batch in batches:
            first: dict[str, Any] | None = None
            for count in processes:
                row: dict[str, Any] = {
                    "strategy": strategy,
                    "batch": batch,
                    "processes": count,
                    "mode": mode,
                    "items": items,
                    "raw": None,
                    "problems": [],
                }
                shape = f"drain {strategy} batch {batch} x{count}"
                if compare_raw:
                    progress.phase(f"{shape}, hand-written")
                    raw = drain_once(
                        target,
                        starter(target, batch, strategy, count, "by hand"),
                        items=items,
                        processes=count,
                        progress=progress,
                        label=f"{shape}, hand-written",
                    )
                    row["raw"] = raw.rate
                    row["problems"] += [f"hand-written loop: {p}" for p in raw.problems]
                progress.phase(f"{shape}, txqueue ({mode})")
                ours = drain_once(
                    target,
                    starter(target, batch, strategy, count, mode),
                    items=items,
                    processes=count,
                    progress=progress,
                    label=f"{shape}, txqueue",
                )
                row["ours"] = ours.rate
                row["processed"] = ours.processed
                row["problems"] += ours.problems
                row["verified"] = not row["problems"]
                row["percent"] = percent(ours.rate, row["raw"])
                first = first or row
                row["percent_of_first"] = percent(ours.rate, first["ours"])
                row["raw_percent_of_first"] = percent(row["raw"], first["raw"])
                rows.append(row)
    return rows
