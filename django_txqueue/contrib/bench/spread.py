"""Spread: one consumer serving many queues, however the work is spread over them.

One consumer (a ``Worker`` in a forked child, as ``drain`` runs it) drains N no-op items
serving one queue, then serving ``QUEUES`` queues with the items all in one of them, in
``HOT`` of them, and spread evenly over all. Each rate is shown as a percentage of the
one-queue rate measured in the same round, with the claim statements the consumer ran
per item (an idle queue that costs a round trip per turn shows here as many claims per
item). Every drain is checked for exactly-once processing. The queues are named after
the bench's own queue (``{queue}-{n}``) and emptied before and after.
"""

from __future__ import annotations

import multiprocessing
import queue as queue_module
import statistics
import time
from typing import Any

from django.db import connections, transaction

from django_txqueue import Consumer, Queue, QueueItem, store

from ..progress import Progress
from ..target import FILL_CHUNK, Target
from .drain import CHILD_TIMEOUT, handle, verify_exactly_once

QUEUES = 50  # queues served by the many-queues consumer
HOT = 5  # queues with work in the "a few hot" shape
ROUNDS = 3  # each shape this many times, interleaved; the median is shown

# (label, queues served, queues with work)
SHAPES = (
    ("1 queue", 1, 1),
    (f"{QUEUES} queues, all in 1", QUEUES, 1),
    (f"{QUEUES} queues, {HOT} hot", QUEUES, HOT),
    (f"{QUEUES} queues, even", QUEUES, QUEUES),
)


def names(target: Target, count: int = QUEUES) -> list[str]:
    return [f"{target.queue}-{n}" for n in range(count)]


def items_of(target: Target) -> Any:
    return QueueItem.objects.using(target.alias).filter(queue__in=names(target))


def clear(target: Target) -> None:
    store.delete_all(items_of(target))


def fill(target: Target, items: int, hot: int) -> None:
    """``items`` READY items spread evenly over the first ``hot`` queues."""
    for n, name in enumerate(names(target, hot)):
        share = items // hot + (1 if n < items % hot else 0)
        queue = Queue(name, using=target.alias)
        for start in range(0, share, FILL_CHUNK):
            with transaction.atomic(using=target.alias):
                chunk = range(start, min(start + FILL_CHUNK, share))
                queue.enqueue_many([{"n": i} for i in chunk])


def consume(target: Target, served: int, batch: int) -> tuple[int, str, int]:
    """In the child: drain with one ``Worker`` serving ``served`` queues; returns what
    it processed, its identity and the claim statements it ran."""
    from django_txqueue import store as store_module
    from django_txqueue.consumer.worker import Worker

    claims = 0
    build = store_module.claim_values

    def counted(*args: Any, **kwargs: Any) -> Any:  # one per claim statement
        nonlocal claims
        claims += 1
        return build(*args, **kwargs)

    store_module.claim_values = counted  # this child only
    worker = Worker(
        handlers=dict.fromkeys(names(target, served), handle),
        using=target.alias,
        batch=batch,
        burst=True,
    )
    worker.run()
    return worker.processed, worker.identity, claims


def child(target: Target, served: int, batch: int, start: Any, results: Any) -> None:
    start.wait()
    started = time.time()
    try:
        processed, identity, claims = consume(target, served, batch)
    except Exception as exc:  # reported, so that the parent neither hangs nor hides it
        results.put(("error", f"{type(exc).__name__}: {exc}"))
    else:
        results.put(("ok", processed, identity, claims, started, time.time()))
    finally:
        connections.close_all()


def verify(target: Target, expected: int, processed: int) -> list[str]:
    """``drain.verify_exactly_once`` over all the queues."""
    return verify_exactly_once(target, expected, processed, items=items_of(target))


def drain_once(target: Target, items: int, batch: int, served: int, hot: int) -> dict[str, Any]:
    clear(target)
    fill(target, items, hot)
    target.analyze()
    connections.close_all()  # the forked consumer opens its own
    context = multiprocessing.get_context("fork")
    start, results = context.Event(), context.Queue()
    process = context.Process(target=child, args=(target, served, batch, start, results))
    process.start()
    start.set()
    report: tuple[Any, ...] | None = None
    try:
        report = results.get(timeout=CHILD_TIMEOUT)
    except queue_module.Empty:
        process.kill()
    process.join()
    problems: list[str] = []
    rate, processed, claims = 0.0, 0, 0
    if report is None:
        problems.append("the consumer died or timed out unreported")
    elif report[0] == "error":
        problems.append(f"the consumer failed: {report[1]}")
    else:
        _, processed, identity, claims, began, ended = report
        rate = processed / (ended - began) if ended > began else 0.0
        store.delete_consumers(Consumer.objects.using(target.alias).filter(identity=identity))
    problems += verify(target, items, processed)
    clear(target)
    return {"rate": rate, "claims": claims, "processed": processed, "problems": problems}


def run(
    target: Target, *, items: int, batches: list[int], progress: Progress
) -> list[dict[str, Any]]:
    """Each batch size: every shape ``ROUNDS`` times, interleaved; the medians."""
    rows = []
    try:
        for batch in batches:
            runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in SHAPES}
            for round_ in range(1, ROUNDS + 1):
                for label, served, hot in SHAPES:
                    progress.phase(f"spread batch {batch}, round {round_}: {label}")
                    runs[label].append(drain_once(target, items, batch, served, hot))
            one = statistics.median(r["rate"] for r in runs[SHAPES[0][0]])
            for label, served, hot in SHAPES:
                rate = statistics.median(r["rate"] for r in runs[label])
                claims = statistics.median(r["claims"] for r in runs[label])
                row = {
                    "shape": label,
                    "batch": batch,
                    "queues": served,
                    "hot": hot,
                    "items": items,
                    "rounds": ROUNDS,
                    "rate": rate,
                    "rates": [r["rate"] for r in runs[label]],
                    "percent": 100.0 * rate / one if one else None,
                    "claims_per_item": claims / items,
                    "problems": [p for r in runs[label] for p in r["problems"]],
                }
                row["verified"] = not row["problems"]
                rows.append(row)
                progress.phase(
                    f"spread batch {batch}, {label}: {rate:,.0f}/s, "
                    f"{row['percent'] or 0:.0f}% of one queue, "
                    f"{row['claims_per_item']:.2f} claims per item"
                    + ("" if row["verified"] else ", NOT exactly once")
                )
    finally:
        clear(target)
    return rows
