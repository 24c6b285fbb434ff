"""A consumer process's Prometheus counters and histograms (the ``prometheus`` extra).

Off unless ``enable()`` is called (``run_queue_consumer --metrics-port``): until then
``recorder`` is None, prometheus_client is never imported, and the consumer's only cost
is one ``is None`` test per batch. On, the consumer's main thread reports each claimed
batch and each settled batch, and its liveness thread each rescue; handler threads
report nothing. Labels are queue names only, never an item id, so a series' count is
bounded by the number of queues.

The database-side gauges (items per status, oldest due item...) are read at scrape
time by ``collector.py``; serving both is ``exposition.py``'s.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .status import Status

if TYPE_CHECKING:
    from .execution import Outcome
    from .models import QueueItem

EXTRA_HINT = "pip install 'django-txqueue[prometheus]'"

# Seconds. Handlers: from a millisecond's no-op to a few minutes' job.
DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
# Seconds from due to claimed: a woken consumer's milliseconds to an hour's backlog.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 3600)
# Items per claim: powers of two up to the largest batch a consumer is given in practice.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class MetricsUnavailable(ImportError):
    """prometheus_client is not installed."""


def prometheus() -> Any:
    """The prometheus_client module, or ``MetricsUnavailable`` naming the extra."""
    try:
        import prometheus_client
    except ImportError as exc:
        raise MetricsUnavailable(
            f"Prometheus metrics need prometheus-client: {EXTRA_HINT}"
        ) from exc
    return prometheus_client


class Recorder:
    """This process's metrics, registered in ``registry`` (None: in no registry, as in
    a child of ``--processes``, whose values go to the multiprocess directory)."""

    def __init__(self, registry: Any = None) -> None:
        client = prometheus()
        kwargs = {"registry": registry}
        self.processed = client.Counter(
            "txqueue_items_processed",
            "Items whose handler returned and whose acknowledgement was accepted.",
            ["queue"],
            **kwargs,
        )
        self.failed = client.Counter(
            "txqueue_items_failed",
            "Items whose handler raised with no attempt left (now FAILED).",
            ["queue"],
            **kwargs,
        )
        self.retried = client.Counter(
            "txqueue_items_retried",
            "Items whose handler raised and that will run again after their retry delay.",
            ["queue"],
            **kwargs,
        )
        self.rescued = client.Counter(
            "txqueue_items_rescued",
            "Stuck items this process's rescues took back (READY again, or FAILED).",
            ["queue"],
            **kwargs,
        )
        self.duration = client.Histogram(
            "txqueue_handler_duration_seconds",
            "How long handlers ran, per item, failures included.",
            ["queue"],
            buckets=DURATION_BUCKETS,
            **kwargs,
        )
        self.latency = client.Histogram(
            "txqueue_enqueue_to_start_seconds",
            "From when an item was due (its enqueue, or its run_at if later) to its claim.",
            ["queue"],
            buckets=LATENCY_BUCKETS,
            **kwargs,
        )
        self.batch = client.Histogram(
            "txqueue_claim_batch_size",
            "Items per claim that gave any.",
            buckets=BATCH_BUCKETS,
            **kwargs,
        )
        # Each metric's child per queue, looked up once: labels() takes a lock each time.
        self._children: dict[tuple[str, str], Any] = {}

    def _child(self, metric: str, queue: str) -> Any:
        key = (metric, queue)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = getattr(self, metric).labels(queue=queue)
        return child

    def claimed(self, items: list[QueueItem]) -> None:
        """One claim's items, on the consumer's main thread."""
        self.batch.observe(len(items))
        now = time.time()
        waits: dict[str, list[float]] = {}
        queue, found = None, None  # a claim is of one queue, but for the outbox's turns
        for item in items:
            due = item.__dict__.get("run_at")  # never load a deferred field for this
            if due is None:
                continue
            if item.queue != queue or found is None:
                queue = item.queue
                found = waits.get(queue)
                if found is None:
                    found = waits[queue] = []
            wait = now - due.timestamp()
            found.append(wait if wait > 0 else 0.0)
        for name, values in waits.items():
            observe_many(self._child("latency", name), values)

    def settled(self, outcomes: Iterable[Outcome]) -> None:
        """Outcomes the database has, on the consumer's main thread: durations observed,
        outcomes counted per queue, each count added once."""
        runs: dict[str, tuple[list[float], list[int]]] = {}  # durations; done, retried, failed
        queue, durations, tally = None, None, None
        for outcome in outcomes:
            if outcome.acknowledged is False or outcome.lost:
                continue  # nothing happened: rolled back, or released to run again
            item = outcome.item
            if item.queue != queue or durations is None or tally is None:
                queue = item.queue
                if queue not in runs:
                    runs[queue] = ([], [0, 0, 0])
                durations, tally = runs[queue]
            durations.append(outcome.duration)
            if outcome.error is None:
                tally[0] += 1
            elif item.status == Status.READY:
                tally[1] += 1
            else:
                tally[2] += 1
        for name, (values, counts) in runs.items():
            observe_many(self._child("duration", name), values)
            for metric, n in zip(("processed", "retried", "failed"), counts, strict=True):
                if n:
                    self._child(metric, name).inc(n)

    def rescued_items(self, queue: str, count: int) -> None:
        if count:
            self._child("rescued", queue).inc(count)


def observe_many(child: Any, values: list[float]) -> None:
    """``child.observe(v)`` for each of ``values``, added as one batch where the client's
    histogram is as expected: one increment per bucket touched and one of the sum,
    instead of two locked increments and a scan of the buckets per value. (Its buckets
    hold per-bucket counts, made cumulative when collected; the bounds are inclusive.)
    Anything else (another prometheus-client) gets the plain calls."""
    bounds = getattr(child, "_upper_bounds", None)
    buckets = getattr(child, "_buckets", None)
    total = getattr(child, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for value in values:
            child.observe(value)
        return
    counts = [0] * len(bounds)
    for value in values:
        counts[bisect_left(bounds, value)] += 1
    for index, count in enumerate(counts):
        if count:
            buckets[index].inc(count)
    total.inc(sum(values))


# This process's recorder, or None: metrics off.
recorder: Recorder | None = None


def enable(registry: Any = None) -> Recorder:
    """Record this process's metrics from now on (once; later calls return the same)."""
    global recorder
    if recorder is None:
        recorder = Recorder(registry)
    return recorder
