"""Backlog scale: the claim rate of one consumer (batch 10) with 10,000 READY rows,
with ``scale_rows`` READY rows, and with ``scale_rows`` finished (DONE) rows under
10,000 READY ones; each as a percentage of the first. The big tables are made by the
database itself (``RawQueue.insert_generated``), then analyzed."""

from __future__ import annotations

import itertools
import time
from typing import Any

from django.db import connections

from ..models import QueueItem
from ..status import Status
from . import Target
from .raw import RawQueue
from .report import Progress, percent

BASE_READY = 10_000
BATCH = 10


def claim_rate(target: Target, claims: int) -> tuple[float, int]:
    """Items per second one consumer claims and settles until it has done ``claims``."""
    from ..worker import Worker

    counter = itertools.count(1)

    def handle(item: QueueItem) -> None:
        if next(counter) >= claims:
            worker.stop()

    worker = Worker(handlers={target.queue: handle}, using=target.alias, batch=BATCH, burst=True)
    started = time.perf_counter()
    worker.run()
    elapsed = time.perf_counter() - started
    target.forget_consumers([worker.identity])
    return worker.processed / elapsed, worker.processed


def run(
    target: Target, *, scale_rows: int, claims: int, progress: Progress
) -> list[dict[str, Any]]:
    backlogs = [
        (f"{BASE_READY:,} ready", BASE_READY, 0),
        (f"{scale_rows:,} ready", scale_rows, 0),
        (f"{scale_rows:,} done + {BASE_READY:,} ready", BASE_READY, scale_rows),
    ]
    claims = min(claims, BASE_READY, scale_rows)
    rows: list[dict[str, Any]] = []
    for label, ready, done in backlogs:
        target.clear()
        progress.phase(f"scale: filling {label}")
        raw = RawQueue(target)
        try:
            if done:
                raw.insert_generated(done, Status.DONE)
            raw.insert_generated(ready, Status.READY)
        finally:
            raw.close()
        target.analyze()
        progress.phase(f"scale: claiming {claims:,} with {label}")
        rate, claimed = claim_rate(target, claims)
        rows.append(
            {"backlog": label, "ready": ready, "done": done, "claimed": claimed, "rate": rate}
        )
    progress.phase("scale: deleting the backlog")
    target.clear()
    connections[target.alias].close()
    for row in rows:
        row["percent"] = percent(row["rate"], rows[0]["rate"])
    return rows
