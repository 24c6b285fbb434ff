"""Backlog scale: the claim rate of one consumer (batch 10) with 10,000 READY rows,
with ``scale_rows`` finished (DONE) rows under 10,000 READY ones, and with ``scale_rows``
READY rows; each as a percentage of the first. The big tables are made by the
database itself (``RawQueue.insert_generated``), then analyzed.

Each window starts with the consumer, so what a consumer does at its start (its
housekeeping thread's first heartbeat, rescue and purge) is in it: a cost there that grows
with the table shows. Beside the rate, the process's CPU time per item (every thread):
on a busy machine the rate swings by a third from run to run, the CPU time much less."""

from __future__ import annotations

import itertools
import time
from typing import Any

from django.db import connections

from django_txqueue import QueueItem, Status
from django_txqueue.db import dialect

from ..progress import Progress
from ..target import Target
from .raw import RawQueue
from .report import percent

BASE_READY = 10_000
BATCH = 10
WARM_UP = 300  # items claimed, not measured, before the first backlog
PURGE_TIMEOUT = 300.0  # seconds


def clear(target: Target, progress: Progress) -> None:
    """Delete the backlog, then, where the server purges deleted rows in the background
    (InnoDB), wait for it: until then their delete-marked index entries slow claims down
    (those in the READY range are read past by every claim) and the purge competes for
    the CPU. PostgreSQL's equivalent, VACUUM, runs in ``Target.analyze``."""
    target.clear()
    purge = dialect(target.connection).purge_progress
    status = purge(target.connection)
    if status is None:
        return
    deleted_before = status[0]
    deadline = time.monotonic() + PURGE_TIMEOUT
    while status is not None and status[1] < deleted_before:
        if time.monotonic() > deadline:
            progress.phase("scale: InnoDB's purge is still behind; measuring anyway")
            break
        progress.tick("scale: waiting for InnoDB to purge the deleted rows")
        time.sleep(0.5)
        status = purge(target.connection)


def claim_rate(target: Target, claims: int) -> tuple[float, int]:
    """Items per second one consumer claims and settles until it has done ``claims``."""
    from django_txqueue.consumer.worker import Worker

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


def fill(target: Target, ready: int, done: int, progress: Progress) -> None:
    """A fresh backlog: ``done`` DONE rows, then ``ready`` READY ones, analyzed."""
    clear(target, progress)
    raw = RawQueue(target)
    try:
        if done:
            raw.insert_generated(done, Status.DONE)
        raw.insert_generated(ready, Status.READY)
    finally:
        raw.close()
    target.analyze()


def run(
    target: Target, *, scale_rows: int, claims: int, progress: Progress
) -> list[dict[str, Any]]:
    # The finished rows before the big ready backlog: deleting a big READY backlog leaves
    # InnoDB's purge (and PostgreSQL's vacuum) work in the very index range a claim reads,
    # which would slow the next backlog's claims for a reason that is the bench's own.
    backlogs = [
        (f"{BASE_READY:,} ready", BASE_READY, 0),
        (f"{scale_rows:,} done + {BASE_READY:,} ready", BASE_READY, scale_rows),
        (f"{scale_rows:,} ready", scale_rows, 0),
    ]
    claims = min(claims, BASE_READY, scale_rows)
    # The first consumer of the process pays for what runs once (imports, compiled
    # statements, the connection's set-up): 15% more CPU per item over 3,000 claims,
    # measured on SQLite. A round not measured first, so the 10,000 baseline, which
    # every other backlog is a percentage of, does not carry it alone.
    progress.phase("scale: warming up")
    fill(target, WARM_UP, 0, progress)
    claim_rate(target, WARM_UP)
    rows: list[dict[str, Any]] = []
    for label, ready, done in backlogs:
        progress.phase(f"scale: filling {label}")
        fill(target, ready, done, progress)
        progress.phase(f"scale: claiming {claims:,} with {label}")
        cpu = time.process_time()
        rate, claimed = claim_rate(target, claims)
        cpu = time.process_time() - cpu
        rows.append(
            {
                "backlog": label,
                "ready": ready,
                "done": done,
                "claimed": claimed,
                "rate": rate,
                "cpu_us": 1e6 * cpu / claimed if claimed else None,
            }
        )
    progress.phase("scale: deleting the backlog")
    clear(target, progress)
    connections[target.alias].close()
    for row in rows:
        row["percent"] = percent(row["rate"], rows[0]["rate"])
        # The rate the CPU time alone allows, as a percentage of the first's.
        row["cpu_percent"] = percent(rows[0]["cpu_us"], row["cpu_us"])
    return rows
