"""Drain: N no-op items, W consumer processes, batch B, each claim strategy; our
consumer (``Worker``) beside the hand-written loop, and every drain checked for
exactly-once processing."""

from __future__ import annotations

import multiprocessing
import queue as queue_module
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from django.db import connections
from django.db.models import Count

from django_txqueue import QueueItem, Status

from ..progress import Progress
from ..target import Target
from .raw import RawQueue
from .report import percent

CHILD_TIMEOUT = 600.0  # seconds a drain may take before the bench gives up on it


def handle(item: QueueItem) -> None:
    """The benchmark's handler: no work, so the figure is the queue's own cost."""


@dataclass
class Drained:
    """One drain: items per second over first start to last finish, and what was wrong."""

    rate: float
    processed: int
    problems: list[str] = field(default_factory=list)


def verify_exactly_once(target: Target, expected: int, processed: int) -> list[str]:
    """Every item of the queue DONE after exactly one attempt, ``expected`` of them, and
    the consumers' own count agreeing: else one sentence per kind of violation."""
    problems = []
    counts = target.items().order_by().values_list("status", "attempts").annotate(n=Count("pk"))
    total = 0
    for status, attempts, n in counts:
        total += n
        if (status, attempts) != (Status.DONE, 1):
            label = Status(status).label
            problems.append(f"{n} item(s) {label} after {attempts} attempt(s), not done after 1")
    if total != expected:
        problems.append(f"{total} items in the queue where {expected} were enqueued")
    if processed != expected:
        problems.append(f"the consumers processed {processed} items, not {expected}")
    return problems


def consume_with_worker(target: Target, batch: int, strategy: str) -> tuple[int, str]:
    from django_txqueue.worker import Worker

    worker = Worker(
        handlers={target.queue: handle},
        using=target.alias,
        batch=batch,
        strategy=strategy,
        burst=True,
    )
    worker.run()
    return worker.processed, worker.identity


def consume_by_hand(target: Target, batch: int, strategy: str) -> tuple[int, str]:
    raw = RawQueue(target)
    try:
        return raw.drain(batch, strategy), ""
    finally:
        raw.close()


Consume = Callable[[Target, int, str], tuple[int, str]]


def child(
    consume: Consume, target: Target, batch: int, strategy: str, start: Any, results: Any
) -> None:
    """One consumer process: wait for the start, drain, report how it went."""
    start.wait()
    started = time.time()
    try:
        processed, identity = consume(target, batch, strategy)
    except Exception as exc:  # reported, so that the parent neither hangs nor hides it
        results.put(("error", f"{type(exc).__name__}: {exc}"))
    else:
        results.put(("ok", processed, identity, started, time.time()))
    finally:
        connections.close_all()


def drain_once(
    target: Target,
    consume: Consume,
    *,
    items: int,
    batch: int,
    strategy: str,
    processes: int,
    progress: Progress,
    label: str,
) -> Drained:
    """Fill ``items``, drain them with ``processes`` forked consumers, verify."""
    target.clear()
    target.fill(items)
    target.analyze()
    connections.close_all()  # each forked consumer opens its own
    context = multiprocessing.get_context("fork")
    start, results = context.Event(), context.Queue()
    children = [
        context.Process(target=child, args=(consume, target, batch, strategy, start, results))
        for _ in range(processes)
    ]
    for process in children:
        process.start()
    began = time.monotonic()
    start.set()
    reports: list[tuple[Any, ...]] = []
    while len(reports) < processes:
        try:
            reports.append(results.get(timeout=0.5))
        except queue_module.Empty:
            if not any(process.is_alive() for process in children) and results.empty():
                break  # a consumer died without reporting: counted as missing below
            if time.monotonic() - began > CHILD_TIMEOUT:
                for process in children:
                    process.kill()
                break
            if progress.live:
                done = target.items().filter(status=Status.DONE).count()
                elapsed = time.monotonic() - began
                progress.tick(f"{label}: {done:,}/{items:,} items, {done / elapsed:,.0f}/s")
    for process in children:
        process.join()
    errors = [report[1] for report in reports if report[0] == "error"]
    finished = [report for report in reports if report[0] == "ok"]
    target.forget_consumers([report[2] for report in finished if report[2]])
    processed = sum(report[1] for report in finished)
    problems = [f"a consumer failed: {error}" for error in errors]
    if len(reports) < processes:
        problems.append(f"{processes - len(reports)} consumer(s) died or timed out unreported")
    problems += verify_exactly_once(target, items, processed)
    rate = 0.0
    if finished:
        elapsed = max(r[4] for r in finished) - min(r[3] for r in finished)
        rate = processed / elapsed if elapsed > 0 else 0.0
    target.clear()
    return Drained(rate, processed, problems)


def run(
    target: Target,
    *,
    items: int,
    batches: list[int],
    processes: int,
    strategies: list[str],
    compare_raw: bool,
    progress: Progress,
) -> list[dict[str, Any]]:
    """Every strategy and batch size: the hand-written loop first, then ours."""
    rows = []
    for strategy in strategies:
        for batch in batches:
            row: dict[str, Any] = {
                "strategy": strategy,
                "batch": batch,
                "processes": processes,
                "items": items,
                "raw": None,
                "problems": [],
            }
            shape = f"drain {strategy} batch {batch} x{processes}"
            if compare_raw:
                progress.phase(f"{shape}, hand-written")
                raw = drain_once(
                    target,
                    consume_by_hand,
                    items=items,
                    batch=batch,
                    strategy=strategy,
                    processes=processes,
                    progress=progress,
                    label=f"{shape}, hand-written",
                )
                row["raw"] = raw.rate
                row["problems"] += [f"hand-written loop: {p}" for p in raw.problems]
            progress.phase(f"{shape}, txqueue")
            ours = drain_once(
                target,
                consume_with_worker,
                items=items,
                batch=batch,
                strategy=strategy,
                processes=processes,
                progress=progress,
                label=f"{shape}, txqueue",
            )
            row["ours"] = ours.rate
            row["processed"] = ours.processed
            row["problems"] += ours.problems
            row["verified"] = not row["problems"]
            row["percent"] = percent(ours.rate, row["raw"])
            rows.append(row)
    return rows
