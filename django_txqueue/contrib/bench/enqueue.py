"""Enqueue: ``enqueue()`` one per transaction against a single-row INSERT in its own
transaction, and ``enqueue_many()`` of 1,000 against one multi-row INSERT of 1,000: into
the queue's own table, and into a minimal one (``raw.MINIMAL_TABLE``: what a project's own
outbox table would cost)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from django.db import connections, transaction

from django_txqueue import Queue

from ..progress import Progress
from ..target import Target
from .raw import RawQueue
from .report import percent

MANY = 1000  # items per enqueue_many call and per multi-row INSERT


def timed(count: int, step: Callable[[int], object], progress: Progress, label: str) -> float:
    """Items per second of ``step(n)`` run for n in range(count)."""
    started = time.perf_counter()
    for n in range(count):
        step(n)
        if n % 100 == 0:
            progress.tick(f"{label}: {n:,}/{count:,}")
    return count / (time.perf_counter() - started)


def run(
    target: Target, *, items: int, compare_raw: bool, progress: Progress
) -> list[dict[str, Any]]:
    queue = Queue(target.queue, using=target.alias)
    rounds = max(1, items // MANY)
    payloads = [{"n": n} for n in range(MANY)]

    def enqueue_one(n: int) -> None:
        with transaction.atomic(using=target.alias):
            queue.enqueue({"n": n})

    def enqueue_many(n: int) -> None:
        queue.enqueue_many(payloads)

    raw = RawQueue(target) if compare_raw else None
    figures: dict[str, dict[str, float | None]] = {
        key: {"raw": None, "minimal": None} for key in ("one", "many")
    }
    try:
        target.clear()
        if raw is not None:
            raw.make_minimal_table()
            progress.phase("enqueue, hand-written single-row INSERT")
            figures["one"]["raw"] = timed(
                items, lambda n: raw.insert_one({"n": n}), progress, "hand-written INSERT"
            )
            target.clear()
            progress.phase("enqueue, hand-written single-row INSERT into a minimal table")
            figures["one"]["minimal"] = timed(
                items,
                lambda n: raw.insert_one({"n": n}, minimal=True),
                progress,
                "hand-written INSERT, minimal table",
            )
        progress.phase("enqueue(), one per transaction")
        figures["one"]["ours"] = timed(items, enqueue_one, progress, "enqueue()")
        target.clear()
        if raw is not None:
            progress.phase(f"enqueue, hand-written INSERT of {MANY:,} rows")
            rate = timed(rounds, lambda n: raw.insert_many(payloads), progress, "multi-row INSERT")
            figures["many"]["raw"] = rate * MANY
            target.clear()
            progress.phase(f"enqueue, hand-written INSERT of {MANY:,} rows into a minimal table")
            rate = timed(
                rounds,
                lambda n: raw.insert_many(payloads, minimal=True),
                progress,
                "multi-row INSERT, minimal table",
            )
            figures["many"]["minimal"] = rate * MANY
        progress.phase(f"enqueue_many() of {MANY:,}")
        figures["many"]["ours"] = timed(rounds, enqueue_many, progress, "enqueue_many()") * MANY
        target.clear()
    finally:
        if raw is not None:
            raw.drop_minimal_table()
            raw.close()
    connections[target.alias].close()  # the next part may fork
    return [
        {
            "what": what,
            "items": count,
            "ours": figures[key]["ours"],
            "raw": figures[key]["raw"],
            "percent": percent(figures[key]["ours"], figures[key]["raw"]),
            "minimal": figures[key]["minimal"],
            "percent_of_minimal": percent(figures[key]["ours"], figures[key]["minimal"]),
        }
        for key, what, count in (
            ("one", "enqueue(), one per transaction", items),
            ("many", f"enqueue_many() of {MANY:,}", rounds * MANY),
        )
    ]
