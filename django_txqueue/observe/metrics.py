"""A consumer process's Prometheus counters and histograms (the ``prometheus`` extra).

Off unless ``enable()`` is called (``run_queue_consumer --metrics-port``): until then
``recorder`` is None, prometheus_client is never imported, and the consumer's only cost
is one ``is None`` test per batch. On, the consumer's main thread reports each claimed
batch and each settled batch (``Recorder``), and its housekeeping thread each rescue;
handler threads report nothing. Labels are queue names only, never an item id, so a
series' count is bounded by the number of queues.

The database-side gauges (items per status, oldest due item...) are read at scrape
time by ``collector.py``; serving both is ``exposition.py``'s.
"""

from __future__ import annotations

import math
import threading
import time
from bisect import bisect_left
from collections.abc import Iterable, Iterator
from datetime import datetime, timedelta
from operator import attrgetter
from typing import TYPE_CHECKING, Any, TypeVar

from ..status import Status

if TYPE_CHECKING:
    from ..consumer.execution import Outcome
    from ..models import QueueItem

EXTRA_HINT = "pip install 'django-txqueue[prometheus]'"

# Seconds. Handlers: from a millisecond's no-op to a few minutes' job.
DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
# Seconds from due to claimed: a woken consumer's milliseconds to an hour's backlog.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 3600)
# Items per claim: powers of two up to the largest batch a consumer is given in practice.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


# What the recorder reads of each item and outcome, in C (``map``).
QUEUE_OF, RUN_AT = attrgetter("queue"), attrgetter("run_at")
ITEM_QUEUE_OF, DURATION = attrgetter("item.queue"), attrgetter("duration")
ERROR, LOST, ACKNOWLEDGED = attrgetter("error"), attrgetter("lost"), attrgetter("acknowledged")
SNOOZED = attrgetter("snooze")
SECOND, NO_WAIT = timedelta(seconds=1), timedelta(0)


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
    """This process's metrics, collected from ``registry`` (None: from no registry, as
    in a child of ``--processes``, whose values go to the multiprocess directory).

    Per claim, the consumer's main thread only counts into plain Python (``Tally``),
    the claim and the outcomes settled since the last one together: no call into
    prometheus-client per value or per batch. The counts reach the client's values in
    one increment per bucket and counter (``flush``): on the main thread once
    ``FLUSH_INTERVAL`` has passed, before every collection (so a scrape reads every
    batch recorded), and in a child of ``--processes`` from a timer
    (``flush_periodically``) and as it exits.
    """

    FLUSH_INTERVAL = 1.0  # seconds

    def __init__(self, registry: Any = None) -> None:
        client = self.client = prometheus()
        self.processed = client.Counter(
            "txqueue_items_processed",
            "Items whose handler returned and whose acknowledgement was accepted.",
            ["queue"],
            registry=None,
        )
        self.failed = client.Counter(
            "txqueue_items_failed",
            "Items whose handler raised with no attempt left (now FAILED).",
            ["queue"],
            registry=None,
        )
        self.retried = client.Counter(
            "txqueue_items_retried",
            "Items whose handler raised and that will run again after their retry delay.",
            ["queue"],
            registry=None,
        )
        self.rescued = client.Counter(
            "txqueue_items_rescued",
            "Stuck items this process's rescues took back (READY again, or FAILED).",
            ["queue"],
            registry=None,
        )
        self.timeouts = client.Counter(
            "txqueue_items_timed_out",
            "Items whose handler ran past its queue's TIMEOUT and was stopped.",
            ["queue"],
            registry=None,
        )
        self.recycles = client.Counter(
            "txqueue_consumer_recycles",
            "Consumer processes recycled (--max-items, --max-memory, --max-age), by limit.",
            ["reason"],
            registry=None,
        )
        self.duration = client.Histogram(
            "txqueue_handler_duration_seconds",
            "How long handlers ran, per item, failures included.",
            ["queue"],
            buckets=DURATION_BUCKETS,
            registry=None,
        )
        self.latency = client.Histogram(
            "txqueue_enqueue_to_start_seconds",
            "From when an item was due (its enqueue, or its run_at if later) to its claim.",
            ["queue"],
            buckets=LATENCY_BUCKETS,
            registry=None,
        )
        self.batch = client.Histogram(
            "txqueue_claim_batch_size",
            "Items per claim that gave any.",
            buckets=BATCH_BUCKETS,
            registry=None,
        )
        self._lock = threading.Lock()  # the tallies: the main thread's, a flush's
        # Each metric's tally per queue, made once: labels() takes a lock each time.
        self._tallies: dict[tuple[str, str], Tally] = {}
        self._batch_sizes = Tally(self.batch)
        # Settled since the last claim: at most the items in flight, held a moment more.
        self._settled: list[Outcome] = []
        self._flushed = time.monotonic()
        if registry is not None:
            registry.register(self)

    def describe(self) -> list[Any]:
        return [family for metric in self._metrics() for family in metric.describe()]

    def collect(self) -> Iterator[Any]:
        """What a registry's collection reads: every batch recorded until now."""
        self.flush()
        for metric in self._metrics():
            yield from metric.collect()

    def _metrics(self) -> tuple[Any, ...]:
        return (
            self.processed,
            self.failed,
            self.retried,
            self.rescued,
            self.timeouts,
            self.recycles,
            self.duration,
            self.latency,
            self.batch,
        )

    def _tally(self, metric: str, queue: str, unit: Any = 1.0) -> Tally:
        key = (metric, queue)
        tally = self._tallies.get(key)
        if tally is None:
            child = getattr(self, metric).labels(queue=queue)
            tally = self._tallies[key] = Tally(child, unit)
        return tally

    def claimed(self, items: list[QueueItem]) -> None:
        """One claim's items, on the consumer's main thread. Per item, only what C does
        (``map``, ``min``, ``sum``): these run for every item a consumer takes."""
        with self._lock:
            self._batch_sizes.add_one(len(items))
            for queue, group in by_queue(items, list(map(QUEUE_OF, items))):
                # Never load a deferred field for this (all of a claim's rows are built
                # alike): run_at comes with every claim.
                first = group[0].__dict__.get("run_at")
                if first is None:
                    continue
                # The waits as timedeltas, in the claimed values' own time zone (naive
                # where USE_TZ is off): compared and summed as such, not converted each.
                waits = list(map(datetime.now(first.tzinfo).__sub__, map(RUN_AT, group)))
                if min(waits) < NO_WAIT:  # the database's clock ahead of this host's
                    waits = [max(wait, NO_WAIT) for wait in waits]
                self._tally("latency", queue, SECOND).add(waits)
            self._count_settled()
        self._flush_when_due()

    def turn(self, settled: list[Outcome], claimed: list[QueueItem]) -> None:
        """A turn of the consumer's main thread: the outcomes the database now has,
        noted, and counted with the next claim (or flush), so that a batch's shares, each
        settled apart, are counted together; then the items claimed (``claimed``)."""
        if settled:
            with self._lock:
                self._settled += settled
        if claimed:
            self.claimed(claimed)

    def _count_settled(self) -> None:
        """Durations observed, outcomes counted per queue. Not counted: an atomic
        handler's refused acknowledgement (rolled back), the database's own failures
        (released to run again), a snooze (to run again)."""
        counted, self._settled = self._settled, []
        if (
            any(map(LOST, counted))
            or False in map(ACKNOWLEDGED, counted)
            or any(s is not None for s in map(SNOOZED, counted))
        ):
            counted = [
                o
                for o in counted
                if o.acknowledged is not False and not o.lost and o.snooze is None
            ]
        for queue, group in by_queue(counted, list(map(ITEM_QUEUE_OF, counted))):
            self._tally("duration", queue).add(list(map(DURATION, group)))
            errors = list(map(ERROR, group))
            failures = len(errors) - errors.count(None)
            self._tally("processed", queue).count += len(group) - failures
            if failures:
                items = [o.item for o in group if o.error is not None]
                retried = sum(1 for item in items if item.status == Status.READY)
                self._tally("retried", queue).count += retried
                self._tally("failed", queue).count += failures - retried

    def rescued_items(self, queue: str, count: int) -> None:
        """On the housekeeping thread: rare, so counted at once."""
        if count:
            with self._lock:
                self._tally("rescued", queue).count += count
            self.flush()

    def timed_out(self, queue: str) -> None:
        """A handler of ``queue`` stopped past its TIMEOUT: counted, and flushed at once
        (the process ends soon)."""
        with self._lock:
            self.timeouts.labels(queue=queue).inc()
        self.flush()

    def recycling(self, reason: str) -> None:
        """The process reached a recycling limit: counted, and flushed at once (the
        process ends soon)."""
        with self._lock:
            self.recycles.labels(reason=reason).inc()
        self.flush()

    def _flush_when_due(self) -> None:
        if time.monotonic() - self._flushed >= self.FLUSH_INTERVAL:
            self.flush()

    def flush(self) -> None:
        """Add the counts recorded since the last flush to prometheus-client's values."""
        with self._lock:
            self._flushed = time.monotonic()
            self._count_settled()
            for tally in (self._batch_sizes, *self._tallies.values()):
                tally.flush()

    def flush_periodically(self) -> None:
        """Flush every ``FLUSH_INTERVAL`` from a daemon thread, for as long as the
        process lives: for a child of ``--processes``, whose values the supervisor
        reads from their files, not from this process's collection."""

        def flush_forever() -> None:
            while True:
                time.sleep(self.FLUSH_INTERVAL)
                self.flush()

        threading.Thread(target=flush_forever, name="txqueue-metrics", daemon=True).start()


T = TypeVar("T")


def by_queue(things: list[T], queues: list[str]) -> Iterable[tuple[str, list[T]]]:
    """``things`` grouped by their ``queues`` (one name per thing, in order), in one
    group when they are all of one queue (a claim's items are, but for the outbox's)."""
    if not things:
        return []
    if queues.count(queues[0]) == len(queues):
        return [(queues[0], things)]
    groups: dict[str, list[T]] = {}
    for thing, queue in zip(things, queues, strict=True):
        groups.setdefault(queue, []).append(thing)
    return groups.items()


class Tally:
    """A counter's or histogram's (or their child's) additions since the last flush,
    in plain Python: ``count`` for a counter; for a histogram, a count per bucket and
    the sum of the values, added to the histogram's own per-bucket counts and sum in one
    increment each where the client's histogram is laid out as expected (its buckets
    hold per-bucket counts, made cumulative when collected; the bounds are inclusive,
    the last is +Inf). Any other histogram (another prometheus-client) gets the plain
    observe() calls at once. The layout is looked at once, not per batch.

    ``unit``: what one of the histogram's units is in the values given: 1.0 for
    numbers, ``SECOND`` for timedeltas (bucketed and summed as timedeltas, then
    divided once). Not thread-safe: the recorder holds its lock around every call.
    """

    def __init__(self, metric: Any, unit: Any = 1.0) -> None:
        self.metric = metric
        self.unit = unit
        self.zero = unit * 0  # 0.0, or timedelta(0)
        self.count = 0
        self.total = self.zero
        bounds: Any = getattr(metric, "_upper_bounds", None)
        buckets: Any = getattr(metric, "_buckets", None)
        total: Any = getattr(metric, "_sum", None)
        expected = all(part is not None for part in (bounds, buckets, total))
        expected = expected and len(bounds) == len(buckets) and bounds[-1] == math.inf
        # The finite bounds in the values' unit (past the last: the +Inf bucket), the
        # per-bucket counts and the sum; None: plain observe() calls.
        self.parts: tuple[Any, Any, Any] | None = None
        if expected:
            self.parts = ([unit * bound for bound in bounds[:-1]], buckets, total)
        self.counts = [0] * len(buckets) if expected else []

    def add(self, values: list[Any]) -> None:
        """Observe ``values`` (a histogram's)."""
        if self.parts is None:
            for value in values:
                self.metric.observe(value / self.unit)
            return
        if not values:
            return
        bounds, counts = self.parts[0], self.counts
        self.total += sum(values, self.zero)
        lowest = bisect_left(bounds, min(values))
        if lowest == bisect_left(bounds, max(values)):  # as a batch's values mostly are
            counts[lowest] += len(values)
            return
        for value in values:
            counts[bisect_left(bounds, value)] += 1

    def add_one(self, value: Any) -> None:
        """Observe one value (a claim's size)."""
        if self.parts is None:
            self.metric.observe(value / self.unit)
            return
        self.counts[bisect_left(self.parts[0], value)] += 1
        self.total += value

    def flush(self) -> None:
        if self.count:
            self.metric.inc(self.count)
            self.count = 0
        if self.parts is None or not any(self.counts):
            return
        _, buckets, total = self.parts
        for index, count in enumerate(self.counts):
            if count:
                buckets[index].inc(count)
        total.inc(self.total / self.unit)
        self.counts, self.total = [0] * len(self.counts), self.zero


# This process's recorder, or None: metrics off.
recorder: Recorder | None = None


def enable(registry: Any = None) -> Recorder:
    """Record this process's metrics from now on (once; later calls return the same)."""
    global recorder
    if recorder is None:
        recorder = Recorder(registry)
    return recorder
