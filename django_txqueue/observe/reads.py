"""What the admin's monitoring pages show: the dashboard's row per queue and throughput
of the last hour, and why each stuck item is stuck. Data only: ``chart`` draws it.

Each figure comes from one grouped query over all queues (never a query per queue, but
for the keys of fair and ordered queues), and each query is served by an index: the
partial status indexes for the unfinished and failed counts, the ``finished_at`` index
for the throughput. DONE rows, 99% of a busy table, are only read for the last hour.
"""

from __future__ import annotations

import datetime as dt
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from django.db.models import Count, DurationField, ExpressionWrapper, Min, QuerySet
from django.db.models.functions import Now, TruncMinute
from django.utils import timezone

from .. import conf, store
from ..consumer import registry
from ..db import dialect_for
from ..models import (
    Consumer,
    ConsumerQuerySet,
    QueueItem,
    QueueItemQuerySet,
    QueuePause,
    QueueProgress,
    QueueRate,
    any_status,
)
from ..status import FINISHED, Status
from ..store import fairness, rates
from ..validation import parse_rate

MINUTES = 60  # the span of the throughput chart
# Queue.stats() counts DONE items up to this many; past that, the planner's estimate
# stands: counting a million finished rows reads them all.
EXACT_DONE_UP_TO = 10_000
# A scrape counts each queue's DONE items while the table holds at most this many rows
# (by its statistics); past that it takes the planner's estimate. No index is led by the
# queue over DONE rows, so a bounded count of a queue with few of them reads the table.
SCRAPE_COUNTS_UP_TO = 100_000


@dataclass
class QueueRow:
    name: str
    database: str = ""  # set where the overview spans several databases
    ready: int = 0
    in_progress: int = 0
    failed: int = 0
    cancelled: int = 0
    waiting: int = 0  # WAITING: a flow's items waiting for others (docs/flows.md)
    stuck: int = 0
    oldest_ready: dt.timedelta | None = None
    consumers: int = 0
    done_last_hour: int = 0
    failed_last_hour: int = 0
    paused: bool = False
    # At most this many running at once (MAX_IN_FLIGHT, docs/limits.md); None: no cap.
    max_in_flight: int | None = None
    # Seconds a handler may run (TIMEOUT, docs/limits.md); None: no limit.
    timeout: float | None = None
    # A rate-limited queue's use of its limits (``rate_stats``); empty: none.
    rates: dict[str, Any] = field(default_factory=dict)
    # Due READY items a spent rate budget holds back (``held_back``): read by ``gauges``.
    held_back: int = 0
    # DONE items, exact up to EXACT_DONE_UP_TO, past that the planner's estimate: read by
    # ``gauges`` only (the dashboard shows the last hour's instead).
    done: int = 0
    # A fair or ordered queue's keys_waiting and top_keys (fairness.key_stats).
    keys: dict[str, Any] | None = None

    @property
    def rate_text(self) -> str:
        """The queue's RATE_LIMIT in words ("5 a minute"), or "" without one."""
        rate = self.rates.get("rate_limit")
        if rate is None:
            return ""
        limit = parse_rate(rate["limit"])
        return f"{limit.limit} {limit.per}"

    @property
    def oldest_ready_text(self) -> str:
        return "" if self.oldest_ready is None else duration(self.oldest_ready)


@dataclass
class Minute:
    start: dt.datetime
    done: int = 0
    failed: int = 0


@dataclass
class RunningItem:
    item: QueueItem
    progress: dict[str, Any]

    @property
    def progress_text(self) -> str:
        return progress_text(self.progress)


def progress_text(report: dict[str, Any] | None) -> str:
    """A progress report as a line: "40 of 100 (40%) · rows", "40 · rows", or "–"."""
    if report is None:
        return "–"
    done, total = report["done"], report["total"]
    text = f"{done:,}"
    if total:
        text += f" of {total:,} ({min(done / total, 1):.0%})"
    return f"{text} · {report['message']}" if report["message"] else text


def running_items(items: QueueItemQuerySet, limit: int = 20) -> list[RunningItem]:
    """The ``limit`` longest-running items that have reported progress in their current
    run, with their reports: one query, over the IN_PROGRESS index."""
    running = store.running_reports(items.filter(status=Status.IN_PROGRESS), QueueProgress)
    reporting = running.filter(progress_report__isnull=False).order_by("claimed_at", "pk")
    return [RunningItem(item, item.progress_report) for item in reporting[:limit]]


@dataclass
class Overview:
    queues: list[QueueRow]
    minutes: list[Minute]
    consumers: int  # live ones, serving any queue
    # The running items that report their progress, longest-running first.
    running: list[RunningItem] = field(default_factory=list)
    generated_at: dt.datetime = field(default_factory=timezone.now)
    databases: list[str] = field(default_factory=list)  # more than one: rows name theirs

    @property
    def keyed(self) -> list[QueueRow]:
        """The fair and ordered queues, with their keys."""
        return [row for row in self.queues if row.keys is not None]

    @property
    def peak(self) -> int:
        """The most items finished in any one minute."""
        return max((m.done + m.failed for m in self.minutes), default=0)


def overview(
    items: QueueItemQuerySet, consumers: ConsumerQuerySet, names: Sequence[str] = ()
) -> Overview:
    """Everything the dashboard shows, read from ``items`` and ``consumers``, with a row for
    each of ``names`` (the configured queues) even when empty: seven queries, and one more
    per fair or ordered queue."""
    rows = {name: QueueRow(name) for name in names}

    def row(name: str) -> QueueRow:
        return rows.setdefault(name, QueueRow(name))

    live = current(items, consumers, row)

    for stuck in items.order_by().stuck().values("queue").annotate(n=Count("pk")):
        row(stuck["queue"]).stuck = stuck["n"]

    for queue in rows.values():  # one query per fair or ordered queue
        queue.max_in_flight = conf.queue_option(queue.name, "MAX_IN_FLIGHT")
        queue.timeout = conf.queue_option(queue.name, "TIMEOUT")
        queue.rates = rate_stats(queue.name, items.db)
        if fairness.needs_key(queue.name):
            queue.keys = fairness.key_stats(items.filter(queue=queue.name, status=Status.READY))

    minutes = last_hour(items, row)
    queues = sorted(rows.values(), key=lambda r: r.name)
    return Overview(queues, minutes, live, running_items(items))


def current(
    items: QueueItemQuerySet, consumers: ConsumerQuerySet, row: Callable[[str], QueueRow]
) -> int:
    """Fill ``row(name)``'s counts of unfinished, failed and cancelled items, its oldest due
    item's wait, its pause and its live consumers, in four grouped queries over all queues;
    returns how many consumers are alive."""
    columns: dict[int, str] = {
        Status.READY: "ready",
        Status.IN_PROGRESS: "in_progress",
        Status.FAILED: "failed",
        Status.CANCELLED: "cancelled",
        Status.WAITING: "waiting",
    }
    counts = items.order_by().filter(any_status(*columns)).values("queue", "status")
    for count in counts.annotate(n=Count("pk")):
        setattr(row(count["queue"]), columns[count["status"]], count["n"])

    for name, age in oldest_ready_ages(items).items():
        row(name).oldest_ready = age or None  # nothing waited yet: shown as none

    for name in QueuePause.objects.using(items.db).values_list("queue", flat=True):
        row(name).paused = True

    live = list(consumers.alive().values_list("queues", flat=True))
    for name, serving in Counter(name for queues in live for name in queues).items():
        row(name).consumers = serving
    return len(live)


def known_queue_names(items: QueueItemQuerySet, consumers: ConsumerQuerySet) -> list[str]:
    """The queues known by name, sorted: configured (``TXQUEUE["QUEUES"]``), with a handler
    registered in this process (``@handler``, a Tasks backend's: a consumer's, or a web
    process's that imported them), listed by a ``Consumer`` row of the items' database
    (running or stopped, until its row is purged), or paused there.

    Read without the items: no index is led by the queue name over every row (those led
    by it hold one status each), so the items' distinct names would cost a read of the
    whole table per name, seconds at a million rows. Queues with unfinished items are
    found by ``current``'s grouped count anyway."""
    names = set(conf.get("QUEUES")) | set(registry.handlers())
    for queues in consumers.values_list("queues", flat=True):
        names.update(queues)
    names.update(QueuePause.objects.using(items.db).values_list("queue", flat=True))
    return sorted(names)


def gauges(
    items: QueueItemQuerySet, consumers: ConsumerQuerySet, names: list[str]
) -> list[QueueRow]:
    """What a Prometheus scrape reads (``collector.py``), per queue with unfinished items
    or live consumers, and ``names`` (``known_queue_names``) even when empty:
    ``current``'s four queries, then per queue its DONE items: counted up to
    ``EXACT_DONE_UP_TO`` while the table is small (``SCRAPE_COUNTS_UP_TO``), else the
    planner's estimate."""
    rows = {name: QueueRow(name) for name in names}

    def row(name: str) -> QueueRow:
        return rows.setdefault(name, QueueRow(name))

    current(items, consumers, row)
    counting = dialect_for(items.db)
    table = counting.table_rows(items)  # statistics; None where none are kept (SQLite)
    exact = table is None or table <= SCRAPE_COUNTS_UP_TO
    for queue in rows.values():
        queue.held_back = held_back(queue.name, items)
        done = items.filter(queue=queue.name, status=Status.DONE)
        if exact:
            queue.done = counting.estimated_count(done, EXACT_DONE_UP_TO)
        else:
            queue.done = counting.approximate_count(done)
    return sorted(rows.values(), key=lambda r: r.name)


def overview_of(aliases: list[str], names: dict[str, list[str]] | None = None) -> Overview:
    """``overview`` of the queues on each database alias (and of ``names[alias]``, empty
    or not), as one: rows name their database when there is more than one, minutes and
    live consumers add up."""
    names = names or {}
    parts = {
        alias: overview(
            QueueItem.objects.using(alias), Consumer.objects.using(alias), names.get(alias, [])
        )
        for alias in aliases
    }
    if len(parts) == 1:
        return next(iter(parts.values()))
    queues = [replace(row, database=alias) for alias, part in parts.items() for row in part.queues]
    minutes = [Minute(minute.start) for minute in next(iter(parts.values())).minutes]
    for part in parts.values():
        for total, minute in zip(minutes, part.minutes, strict=True):
            total.done += minute.done
            total.failed += minute.failed
    consumers = sum(part.consumers for part in parts.values())
    running = [running for part in parts.values() for running in part.running]
    return Overview(queues, minutes, consumers, running, databases=list(parts))


def oldest_ready_ages(
    items: QueueItemQuerySet, names: Sequence[str] = ()
) -> dict[str, dt.timedelta]:
    """How long each queue's oldest due item (of ``names``' queues, else of every queue)
    has waited past its ``run_at``: one grouped MIN over the READY index, as the
    dashboard's row reads it; queues with nothing due are absent."""
    due = items.order_by().ready()
    if names:
        due = due.filter(queue__in=names)
    waited = ExpressionWrapper(Now() - Min("run_at"), output_field=DurationField())
    ages = {}
    for oldest in due.values("queue").annotate(age=waited):
        if oldest["age"] is not None:
            ages[oldest["queue"]] = max(oldest["age"], dt.timedelta(0))
    return ages


def last_hour(items: QuerySet[QueueItem], row: Callable[[str], QueueRow]) -> list[Minute]:
    """DONE and FAILED per minute over the last hour, oldest first; per-queue totals go
    into ``row(name)``. Minutes are cut in UTC, so MySQL needs no time zone tables."""
    now = timezone.now()
    first = now.replace(second=0, microsecond=0) - dt.timedelta(minutes=MINUTES - 1)
    starts = [first + dt.timedelta(minutes=i) for i in range(MINUTES)]
    minutes = {start: Minute(start) for start in starts}
    finished = (
        items.order_by()
        .filter(finished_at__gte=first, status__in=FINISHED)
        .annotate(minute=TruncMinute("finished_at", tzinfo=dt.UTC))
        .values("queue", "minute", "status")
        .annotate(n=Count("pk"))
    )
    for group in finished:
        if group["status"] == Status.CANCELLED:
            continue  # neither done nor failed: the dashboard counts them apart
        n, done = group["n"], group["status"] == Status.DONE
        queue = row(group["queue"])
        queue.done_last_hour += n if done else 0
        queue.failed_last_hour += 0 if done else n
        minute = minutes.get(group["minute"])
        if minute is not None:  # None: finished a little ahead of this process's clock
            minute.done += n if done else 0
            minute.failed += 0 if done else n
    return list(minutes.values())


# -- stuck items -------------------------------------------------------------------------


@dataclass
class StuckItem:
    item: QueueItem
    consumer: Consumer | None
    reason: str
    overdue: dt.timedelta  # since the moment it became stuck

    @property
    def overdue_text(self) -> str:
        return duration(self.overdue)


def stuck_items(
    items: QueueItemQuerySet, consumers: ConsumerQuerySet, limit: int
) -> list[StuckItem]:
    """The ``limit`` longest-claimed stuck items, each with why and for how long: two
    queries, times on the database's clock as ``stuck()`` reads them."""
    stuck = list(items.stuck().annotate(db_now=Now()).order_by("claimed_at", "pk")[:limit])
    known = consumers.filter(identity__in={item.pid for item in stuck})
    by_identity = {consumer.identity: consumer for consumer in known}
    silence = dt.timedelta(seconds=conf.get("CONSUMER_TIMEOUT"))
    explained = []
    for item in stuck:
        now: dt.datetime = item.db_now
        consumer = by_identity.get(item.pid)
        since: list[tuple[dt.datetime, str]] = []
        if item.lease_expires_at is not None and item.lease_expires_at < now:
            since.append((item.lease_expires_at, "lease expired"))
        if consumer is not None and consumer.stopped_at is not None:
            since.append((consumer.stopped_at, "consumer stopped"))
        elif consumer is not None and consumer.last_heartbeat_at + silence < now:
            since.append((consumer.last_heartbeat_at + silence, "consumer stopped heartbeating"))
        if not since:  # its consumer beat again between the two reads: stuck as of now
            since.append((now, "lease expired"))
        became_stuck = min(moment for moment, _ in since)
        reason = "; ".join(why for _, why in sorted(since))
        explained.append(
            StuckItem(item, consumer, reason, max(now - became_stuck, dt.timedelta(0)))
        )
    return explained


def duration(span: dt.timedelta) -> str:
    """ "45 s", "3 min 12 s", "2 h 5 min", "3 d 4 h": two units at most."""
    seconds = int(span.total_seconds())
    units = (("d", 86400), ("h", 3600), ("min", 60), ("s", 1))
    parts: list[str] = []
    for name, size in units:
        if seconds >= size or (name == "s" and not parts):
            parts.append(f"{seconds // size} {name}")
            seconds %= size
        if len(parts) == 2 or (parts and not seconds):
            break
    return " ".join(parts)


def rate_stats(name: str, using: str) -> dict[str, Any]:
    """A rate-limited queue's limits and their use (docs/limits.md): ``rate_limit``
    (``limit``, items ``used`` in the period that ends now) and ``rate_limit_per_key``
    (``limit``, ``keys_spent``); no query for a queue without one."""
    limits, stats = store.Limits.of(name), {}
    if limits.rate is not None:
        used = rates.used(QueueRate, name, limits.rate, using)
        stats["rate_limit"] = {"limit": str(limits.rate), "used": used}
    if limits.per_key is not None:
        spent = rates.keys_spent(QueueRate, name, using)
        stats["rate_limit_per_key"] = {"limit": str(limits.per_key), "keys_spent": spent}
    return stats


def held_back(name: str, items: QueueItemQuerySet) -> int:
    """How many of queue ``name``'s due READY items a spent rate budget holds back: all of
    them while the queue's own is spent, else those of the keys whose budget is; no
    query for a queue without a rate limit."""
    limits = store.Limits.of(name)
    if limits.rate is None and limits.per_key is None:
        return 0
    due = items.ready().filter(queue=name)
    if limits.rate is not None and rates.used(QueueRate, name, limits.rate, items.db) >= (
        limits.rate.limit
    ):
        return due.count()
    if limits.per_key is None:
        return 0
    spent = QueueRate.objects.using(items.db).filter(
        queue=name, per_key=True, full_until__gt=Now()
    )
    return due.filter(key__in=spent.values("key")).count()


def queue_stats(name: str, items: QueueItemQuerySet) -> dict[str, Any]:
    """``Queue.stats()``: counts per status, stuck items, how long the oldest due item has
    waited, whether the queue is paused, for a capped queue ``max_in_flight``, for one
    with a time limit ``timeout``, for a rate-limited one ``rate_limit`` and
    ``rate_limit_per_key`` (``rate_stats``), and for a fair or ordered queue
    ``keys_waiting`` and ``top_keys``.

    Never reads all the finished rows: READY, IN_PROGRESS, WAITING, FAILED and CANCELLED
    items are counted exactly from their indexes; DONE items exactly up to
    ``EXACT_DONE_UP_TO``, past that the planner's estimate stands (PostgreSQL, MySQL).
    """
    indexed = any_status(
        Status.READY, Status.IN_PROGRESS, Status.WAITING, Status.FAILED, Status.CANCELLED
    )
    counts = items.order_by().filter(indexed).values("status").annotate(n=Count("pk"))
    by_status = {row["status"]: row["n"] for row in counts}
    done = items.filter(status=Status.DONE)
    by_status[Status.DONE] = dialect_for(items.db).estimated_count(done, EXACT_DONE_UP_TO)
    waited = items.ready().aggregate(
        age=ExpressionWrapper(Now() - Min("run_at"), output_field=DurationField())
    )["age"]
    stats = {
        "queue": name,
        "ready": by_status.get(Status.READY, 0),
        "in_progress": by_status.get(Status.IN_PROGRESS, 0),
        "waiting": by_status.get(Status.WAITING, 0),
        "done": by_status.get(Status.DONE, 0),
        "failed": by_status.get(Status.FAILED, 0),
        "cancelled": by_status.get(Status.CANCELLED, 0),
        "stuck": items.stuck().count(),
        "oldest_ready_age_s": max(waited.total_seconds(), 0.0) if waited else 0.0,
        "paused": QueuePause.objects.using(items.db).filter(queue=name).exists(),
    }
    if (cap := conf.queue_option(name, "MAX_IN_FLIGHT")) is not None:
        stats["max_in_flight"] = cap  # a capped queue's (docs/limits.md)
    if (timeout := conf.queue_option(name, "TIMEOUT")) is not None:
        stats["timeout"] = timeout  # how long its handlers may run
    stats.update(rate_stats(name, items.db))
    if fairness.needs_key(name):
        stats.update(fairness.key_stats(items.filter(status=Status.READY)))
    return stats
