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
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

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
        client = self.client = prometheus()
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
        self._batch_buckets = Buckets(self.batch)

    def _child(self, metric: str, queue: str) -> Any:
        key = (metric, queue)
        child = self._children.get(key)
        if child is None:
            child = getattr(self, metric).labels(queue=queue)
            if isinstance(getattr(self, metric), self.client.Histogram):
                child = Buckets(child)
            self._children[key] = child
        return child

    def claimed(self, items: list[QueueItem]) -> None:
        """One claim's items, on the consumer's main thread."""
        self._batch_buckets.observe([len(items)])
        now = time.time()
        for queue, group in by_queue(items, lambda item: item.queue):
            # Never load a deferred field for this: run_at comes with every claim.
            dues = [item.__dict__.get("run_at") for item in group]
            waits = [now - due.timestamp() for due in dues if due is not None]
            self._child("latency", queue).observe([w if w > 0 else 0.0 for w in waits])

    def settled(self, outcomes: list[Outcome]) -> None:
        """Outcomes the database has, on the consumer's main thread: durations observed,
        outcomes counted per queue, each count added once. Not counted: an atomic
        handler's refused acknowledgement (rolled back), the database's own failures
        (released to run again)."""
        counted = [o for o in outcomes if o.acknowledged is not False and not o.lost]
        for queue, group in by_queue(counted, lambda outcome: outcome.item.queue):
            self._child("duration", queue).observe([o.duration for o in group])
            errors = [o.item for o in group if o.error is not None]
            retried = sum(1 for item in errors if item.status == Status.READY)
            for metric, n in (
                ("processed", len(group) - len(errors)),
                ("retried", retried),
                ("failed", len(errors) - retried),
            ):
                if n:
                    self._child(metric, queue).inc(n)

    def rescued_items(self, queue: str, count: int) -> None:
        if count:
            self._child("rescued", queue).inc(count)


T = TypeVar("T")


def by_queue(things: list[T], queue_of: Callable[[T], str]) -> Iterable[tuple[str, list[T]]]:
    """``things`` grouped by queue, in one group without a look-up per thing when they
    are all of one queue (a claim's items are, but for the outbox's turns)."""
    if not things:
        return []
    first = queue_of(things[0])
    if all(queue_of(thing) == first for thing in things):
        return [(first, things)]
    groups: dict[str, list[T]] = {}
    for thing in things:
        groups.setdefault(queue_of(thing), []).append(thing)
    return groups.items()


class Buckets:
    """A histogram (or a child of one) that takes a batch of values at once: one
    increment per bucket touched and one of the sum, instead of two locked increments
    and a scan of the buckets per value, where the client's histogram is laid out as
    expected (its buckets hold per-bucket counts, made cumulative when collected; the
    bounds are inclusive). Anything else (another prometheus-client) gets the plain
    calls. The layout is looked at once, not per batch."""

    def __init__(self, histogram: Any) -> None:
        self.histogram = histogram
        bounds: Any = getattr(histogram, "_upper_bounds", None)
        buckets: Any = getattr(histogram, "_buckets", None)
        total: Any = getattr(histogram, "_sum", None)
        expected = all(part is not None for part in (bounds, buckets, total))
        expected = expected and len(bounds) == len(buckets)
        # The bounds, the per-bucket counts and the sum; None: plain observe() calls.
        self.parts: tuple[Any, Any, Any] | None = (bounds, buckets, total) if expected else None

    def observe(self, values: list[float]) -> None:
        if self.parts is None:
            for value in values:
                self.histogram.observe(value)
            return
        if not values:
            return
        bounds, buckets, total = self.parts
        counts: dict[int, int] = {}
        for value in values:
            index = bisect_left(bounds, value)
            counts[index] = counts.get(index, 0) + 1
        for index, count in counts.items():
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
