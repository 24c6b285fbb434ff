"""Periodic items: ``TXQUEUE["SCHEDULE"]``'s entries, their ticks, and their enqueue.

Every host computes the same ticks for an entry: a CRON entry's are the times its
expression gives in ``TIME_ZONE`` (cronsim, which treats daylight-saving changes as
Debian's cron does); an EVERY entry's are the multiples of EVERY seconds since the Unix
epoch. A consumer's housekeeping thread runs a ``Scheduler`` for the entries of the queues it
serves on its database: each look enqueues every tick since its previous one, in one
transaction with the tick's ``ScheduleTick`` row, whose unique (name, tick) lets one
consumer only enqueue it (``store.enqueue_tick``); no consumer leads. At a consumer's
start an entry's ticks missed while none ran are not all made up for: only the latest,
if it was not enqueued yet. The item goes in due at its tick (``run_at``), so hosts whose
clocks differ still run it by the database's.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from cronsim import CronSim
from django.conf import settings
from django.db import DatabaseError, transaction
from django.db.models import Max
from django.utils import timezone

from . import conf, store
from .api import Queue, home_database
from .models import Schedule, ScheduleTick
from .validation import cron_problem as cron_problem  # its old home

logger = logging.getLogger(__name__)

# An entry's keys (upper or lower case, as every TXQUEUE key).
KEYS = (
    "QUEUE", "CRON", "EVERY", "PAYLOAD", "PRIORITY", "KEY", "TASK", "ARGS", "KWARGS", "CATCH_UP"
)  # fmt: skip
# Tick rows kept per entry: the winner of a tick deletes the entry's older ones, so the
# table holds about this many rows per entry (the latest is the entry's last run).
KEEP_TICKS = 10
# A consumer that looks late (a suspended process) enqueues at most this many of an
# entry's ticks since its previous look, the latest ones.
MOST_TICKS_PER_LOOK = 100
# The longest a consumer waits between looks: new queues found meanwhile get their
# entries' ticks from then on.
LONGEST_WAIT = 60.0
# Ticks a cron expression may give out of order around a daylight-saving change (cronsim
# fixes an hour skipped or repeated up); a bound on the steps taken past them.
CRON_STEPS = 10


@dataclass(frozen=True)
class Entry:
    """One ``SCHEDULE`` entry, its keys upper-cased, as the system checks let it through."""

    name: str
    cron: str | None = None
    every: int | None = None
    queue: str | None = None
    payload: Any = None
    priority: int = 0
    key: str | None = None
    task: str | None = None
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    # At a consumer's start (or when a row is enabled again): "latest" enqueues the latest
    # tick missed, if it was not enqueued yet; "none" skips the missed ticks.
    catch_up: str = "latest"

    @classmethod
    def of(cls, name: str, options: dict[str, Any]) -> Entry:
        upper = {str(key).upper(): value for key, value in options.items()}
        return cls(
            name=name,
            cron=upper.get("CRON"),
            every=upper.get("EVERY"),
            queue=upper.get("QUEUE"),
            payload=upper.get("PAYLOAD"),
            priority=upper.get("PRIORITY") or 0,
            key=upper.get("KEY"),
            task=upper.get("TASK"),
            args=list(upper.get("ARGS") or []),
            kwargs=dict(upper.get("KWARGS") or {}),
            catch_up=upper.get("CATCH_UP", Schedule.CatchUp.LATEST),
        )

    @classmethod
    def of_row(cls, row: Schedule) -> Entry:
        """The entry of a ``Schedule`` row (its blank fields are the keys left out)."""
        return cls(
            name=row.name,
            cron=row.cron or None,
            every=row.every,
            queue=row.queue or None,
            payload=row.payload,
            priority=row.priority,
            key=row.key or None,
            task=row.task or None,
            args=list(row.args or []),
            kwargs=dict(row.kwargs or {}),
            catch_up=row.catch_up,
        )

    # -- where it goes -------------------------------------------------------------

    def load_task(self) -> Any:
        """The Django Task of a TASK entry."""
        from .tasks import backend  # only for TASK entries: it imports the Tasks framework

        if backend.TASKS_FRAMEWORK is None:
            raise ValueError("TASK entries need Django's Tasks framework")
        return backend.load_task(str(self.task))

    def queue_name(self) -> str:
        """The queue its items go to: QUEUE, or the task's queue."""
        return str(self.queue) if self.task is None else str(self.load_task().queue_name)

    def database(self) -> str:
        """Where its items and tick rows go: the queue's home, or for a TASK the
        database its backend enqueues the task on."""
        if self.task is None:
            return home_database(str(self.queue))
        from .tasks.backend import TxQueueBackend

        task = self.load_task()
        backend = task.get_backend()
        if not isinstance(backend, TxQueueBackend):
            raise ValueError(f"task {self.task!r} goes to backend {task.backend!r}, not ours")
        return backend.database or home_database(task.queue_name)

    def target(self) -> str:
        """What it enqueues, for people: "queue reports" or "task app.tasks.f (queue q)"."""
        if self.task is None:
            return f"queue {self.queue}"
        return f"task {self.task} (queue {self.queue_name()})"

    def timing(self) -> str:
        """Its CRON expression and time zone, or its interval."""
        if self.cron is not None:
            return f"cron {self.cron} ({settings.TIME_ZONE})"
        return f"every {self.every} s"

    # -- its ticks -----------------------------------------------------------------

    def ticks(self, since: datetime, until: datetime) -> list[datetime]:
        """The ticks after ``since`` up to ``until`` (the latest MOST_TICKS_PER_LOOK)."""
        if self.every is not None:
            last = int(until.timestamp() // self.every)
            first = max(int(since.timestamp() // self.every) + 1, last - MOST_TICKS_PER_LOOK + 1)
            return [epoch_time(step * self.every) for step in range(first, last + 1)]
        found: deque[datetime] = deque(maxlen=MOST_TICKS_PER_LOOK)
        for tick in self._cron_from(since):
            if tick > until:
                break
            if tick > since:  # around a change of clocks, cronsim may give one before
                found.append(tick)
        return list(found)

    def latest(self, at: datetime) -> datetime | None:
        """The latest tick at or before ``at``."""
        if self.every is not None:
            return epoch_time(int(at.timestamp() // self.every) * self.every)
        start = local(at).replace(microsecond=0) + timedelta(seconds=1)
        latest = next(CronSim(str(self.cron), start, reverse=True), None)
        if latest is None:
            return None
        latest = latest.astimezone(UTC)
        # Going backwards through a repeated hour loses which pass it was in: step
        # forwards again to the last tick that is not after ``at``.
        for _, tick in zip(range(CRON_STEPS), self._cron_from(latest), strict=False):
            if tick > at:
                break
            latest = max(latest, tick)
        return latest

    def next_after(self, at: datetime) -> datetime | None:
        """The first tick after ``at`` (None: the expression gives none in 50 years)."""
        if self.every is not None:
            return epoch_time((int(at.timestamp() // self.every) + 1) * self.every)
        for _, tick in zip(range(CRON_STEPS), self._cron_from(at), strict=False):
            if tick > at:
                return tick
        return None

    def before(self, tick: datetime, count: int) -> datetime:
        """The tick ``count`` ticks before ``tick`` (as far back as the expression
        gives)."""
        if self.every is not None:
            return tick - timedelta(seconds=count * self.every)
        earlier = tick
        reverse = CronSim(str(self.cron), local(tick), reverse=True)
        for _, found in zip(range(count), reverse, strict=False):
            earlier = min(earlier, found.astimezone(UTC))
        return earlier

    def _cron_from(self, at: datetime) -> Iterator[datetime]:
        """The expression's times after ``at``, in UTC."""
        for tick in CronSim(str(self.cron), local(at)):
            yield tick.astimezone(UTC)

    # -- its items -----------------------------------------------------------------

    def enqueue(self, tick: datetime, using: str) -> int:
        """Enqueue the item of ``tick`` on ``using`` (the caller's transaction), due at the
        tick; its primary key. A TASK entry's goes through the task's backend, so that it
        is that task's, with its queue and priority."""
        run_at = stored(tick)
        if self.task is None:
            queue = Queue(str(self.queue), using=using)
            item = queue.enqueue(self.payload, priority=self.priority, run_at=run_at, key=self.key)
            return int(item.pk)
        task = self.load_task().using(run_after=run_at)
        return int(task.enqueue(*self.args, **self.kwargs).id)


def entries() -> list[Entry]:
    """The entries of ``TXQUEUE["SCHEDULE"]``."""
    return [Entry.of(name, options) for name, options in (conf.get("SCHEDULE") or {}).items()]


def database_entries() -> list[Entry]:
    """The enabled ``Schedule`` rows' entries, in one query (on the database Django's router
    reads ``Schedule`` from). A row named as a settings entry is left out: settings win
    (the admin refuses such a name; this covers a settings entry added later)."""
    taken = set(conf.get("SCHEDULE") or {})
    rows = Schedule.objects.filter(enabled=True).exclude(name__in=taken)
    return [Entry.of_row(row) for row in rows]


def every_entry() -> list[Entry]:
    """The settings' entries and the enabled rows', as the consumers run them."""
    return [*entries(), *database_entries()]


def run_now(row: Schedule) -> int:
    """Enqueue one item of ``row``'s entry now, as its ticks are (the admin's "run now");
    its primary key. It is not a tick: the entry's ticks go on as scheduled."""
    entry = Entry.of_row(row)
    using = entry.database()
    with transaction.atomic(using=using):
        return entry.enqueue(datetime.now(UTC), using)


def epoch_time(seconds: int) -> datetime:
    return datetime.fromtimestamp(seconds, tz=UTC)


def local(moment: datetime) -> datetime:
    """``moment`` in ``TIME_ZONE``, where cron expressions are read."""
    return moment.astimezone(timezone.get_default_timezone())


def stored(moment: datetime) -> datetime:
    """``moment`` (aware) as the database keeps it: naive local time when USE_TZ is off."""
    return moment if settings.USE_TZ else timezone.make_naive(moment)


def loaded(moment: datetime) -> datetime:
    """A time the database gave back, aware."""
    return moment if timezone.is_aware(moment) else timezone.make_aware(moment)


def last_ticks(using: str, names: Collection[str]) -> dict[str, datetime]:
    """The latest tick enqueued of each of the entries ``names`` that has one."""
    rows = (
        ScheduleTick.objects.using(using)
        .filter(name__in=list(names))
        .values_list("name")
        .annotate(last=Max("tick"))
        .values_list("name", "last")
    )
    return {name: loaded(last) for name, last in rows}


class Scheduler:
    """The entries one consumer enqueues on database ``using``: those of the queues it
    serves there. Run by its housekeeping thread, which calls ``look`` when it says."""

    def __init__(self, using: str) -> None:
        self.using = using
        # Each entry looked at before: the time of that look.
        self.since: dict[str, datetime] = {}
        # Entries whose queue could not be found out (a TASK that does not load), told once.
        self.unknown: set[str] = set()

    def look(self, served: Collection[str]) -> float:
        """Enqueue the due ticks of the entries of queues ``served``; seconds until the
        next tick of any (at most LONGEST_WAIT)."""
        now = datetime.now(UTC)
        mine = [entry for entry in every_entry() if self._serves(entry, served)]
        new = [entry.name for entry in mine if entry.name not in self.since]
        recorded = last_ticks(self.using, new) if new else {}
        for entry in mine:
            since = self.since.get(entry.name)
            if since is None:  # start-up: the latest tick missed, if any was
                latest, last = entry.latest(now), recorded.get(entry.name)
                due = [latest] if latest is not None and last is not None and latest > last else []
                if entry.catch_up == "none":
                    due = []
            else:
                due = entry.ticks(since, now)
            for tick in due:
                self._enqueue(entry, tick)
            self.since[entry.name] = now
        self.since = {entry.name: self.since[entry.name] for entry in mine}
        upcoming = [at for entry in mine if (at := entry.next_after(now)) is not None]
        if not upcoming:
            return LONGEST_WAIT
        wait = (min(upcoming) - datetime.now(UTC)).total_seconds()
        return min(max(wait, 0.0), LONGEST_WAIT)

    def _serves(self, entry: Entry, served: Collection[str]) -> bool:
        """Whether ``entry``'s items go to a queue served here, on this database. One whose
        TASK does not load (the system checks say so too) is nobody's: the others go on."""
        try:
            return entry.queue_name() in served and entry.database() == self.using
        except Exception as exc:
            if entry.name not in self.unknown:
                self.unknown.add(entry.name)
                logger.warning("schedule entry %r is not enqueued: %s", entry.name, exc)
            return False

    def _enqueue(self, entry: Entry, tick: datetime) -> None:
        """Enqueue ``tick`` of ``entry`` unless another consumer did; the winner trims
        the entry's old tick rows. Only a database error stops the look (it is retried);
        any other is logged, and the tick is given up."""
        try:
            pk = store.enqueue_tick(
                ScheduleTick,
                entry.name,
                stored(tick),
                self.using,
                lambda: entry.enqueue(tick, self.using),
            )
        except DatabaseError:
            raise
        except Exception:
            logger.exception("schedule entry %r: could not enqueue its tick %s", entry.name, tick)
            return
        if pk is None:
            return
        logger.info("schedule entry %r: tick %s enqueued as item %s", entry.name, tick, pk)
        earliest_kept = stored(entry.before(tick, KEEP_TICKS - 1))
        store.trim_ticks(ScheduleTick, entry.name, earliest_kept, self.using)


@dataclass
class Row:
    """One entry as ``txqueue_schedule`` and the dashboard show it."""

    name: str
    target: str
    timing: str
    last_run: datetime | None
    next_run: datetime | None


def overview(of: Collection[Entry] | None = None) -> list[Row]:
    """Every entry of settings (or those ``of``) with its last run (its latest tick
    enqueued) and its next run: one query per database the entries' items go to. An entry
    the system checks refuse shows why in place of what it enqueues."""
    now = datetime.now(UTC)
    found = sorted(entries() if of is None else of, key=lambda entry: entry.name)
    placed: dict[str, list[str]] = {}
    targets: dict[str, str] = {}
    for entry in found:
        try:
            placed.setdefault(entry.database(), []).append(entry.name)
            targets[entry.name] = entry.target()
        except Exception as exc:  # a TASK that does not load: the checks say more
            targets[entry.name] = f"(not enqueued: {exc})"
    last: dict[str, datetime] = {}
    for using, names in placed.items():
        last.update(last_ticks(using, names))
    return [
        Row(
            name=entry.name,
            target=targets[entry.name],
            timing=entry.timing(),
            last_run=last.get(entry.name),
            next_run=entry.next_after(now),
        )
        for entry in found
    ]
