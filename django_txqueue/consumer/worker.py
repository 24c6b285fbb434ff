"""The consumer loop: claim, hand to handler threads, settle; stop gracefully.

Each turn goes one way, per database (``_serve``): the outcomes the handler threads handed
over go to the ``Settler``, which writes them and claims the next batch in the same call
(through the ``Rotation``'s choice of queue and the ``Claimer``), one fenced
acknowledgement of a batch's successes riding with that claim where that saves a round
trip or a commit (PostgreSQL: one statement; MySQL, MariaDB and SQLite: one transaction); the
claimed items go to the handler threads. Handlers run on ``concurrency`` threads, so the
main thread stays free to enforce the shutdown timeout; with more than one, the next batch
is claimed while one runs. A consumer that is its process's own (``run_queue_consumer``,
given its ``StopSignals``) runs them on the loop's thread at concurrency 1, watched by a
``Watchdog`` (``stopping.py``) that enforces the limits meanwhile. The ``Housekeeping``
thread keeps the Consumer row, the leases and rescues. No SQL here, no argument parsing,
no printing: the command does those and hears about progress through a callback and
logging.
"""

from __future__ import annotations

import logging
import math
import os
import queue as queue_module
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial

from django.db import Error as DatabaseError
from django.db import InterfaceError, OperationalError, connections

from .. import conf, store
from ..api import Queue
from ..db import dialect_for
from ..models import Consumer, QueueItem
from ..observe import metrics
from ..observe.logs import counted, forget_queries, one_line
from ..status import Status
from ..store.backoff import RECONNECT_MAX_PAUSE, jittered, next_pause
from . import registry, timeouts
from .claims import Claimer
from .coroutines import BLOCKED_LOOP_GRACE, EventLoop, arun_item
from .execution import Outcome, close_broken_connections, close_if_broken, drop_connection, runner
from .housekeeping import Housekeeping
from .recycling import Recycler, Recycling, kind
from .rotation import Rotation
from .settle import Settler
from .stopping import StopSignals, Watchdog
from .wakeup import Waiter

logger = logging.getLogger(__name__)

# Seconds a burst run waits for a database that does not answer before it exits 1: a cron
# or CI drain must end, and a restart or a failover is over well within it.
BURST_WAIT = 300.0
# A progress report counts each queue's ready items up to this many; past it, the
# database's estimate, said to be one.
BACKLOG_COUNTED_UP_TO = 1000
FIRST_IDLE_WAIT = 0.05  # seconds; doubles while idle, up to POLL_INTERVAL


@dataclass
class Progress:
    processed: int
    failed: int
    rate: float
    backlog: int
    in_flight: int
    # Whether ``backlog`` is counted (up to BACKLOG_COUNTED_UP_TO ready items), or the
    # database's estimate past that.
    backlog_exact: bool = True

    @property
    def backlog_text(self) -> str:
        """The backlog as a line says it: "12", or "about 15000" for an estimate."""
        return str(self.backlog) if self.backlog_exact else f"about {self.backlog}"


@dataclass
class Station:
    """One database a consumer serves: its queues in turn (``Rotation``), its claims of
    them (``Claimer``), its settler, the outcomes its handler threads hand over, and
    (made by ``Worker.run()``) its housekeeping thread."""

    alias: str
    rotation: Rotation
    settler: Settler
    arrived: queue_module.SimpleQueue[list[Outcome]] = field(
        default_factory=queue_module.SimpleQueue
    )
    housekeeping: Housekeeping | None = None
    # Whether its last turn had room to claim, so that its settler claimed (a burst run
    # ends only after a turn in which every station claimed, and nothing was given).
    had_room: bool = False
    # After its database failed: the pause before the next try, and when that is due
    # (monotonic); the other stations go on meanwhile.
    backoff: float = 0.0
    down_until: float = 0.0
    # When its database first failed, of the failures since it last answered (monotonic;
    # 0: it answers): a burst run gives up after ``Worker.burst_wait`` of them.
    down_since: float = 0.0


class Worker:
    """Consume ``handlers``' queues until stopped (or drained): all from database
    ``using``, or, given ``{alias: [queue, ...]}``, each from its own, in one loop.

    ``discover``, if given, is asked for a handler for each queue with ready items
    that has none yet (None: not ours), every few seconds (``Rotation``). Every worker
    also runs the ``on_commit`` calls whose committing process did not (``outbox``).
    Making one opens nothing: ``run()`` opens its wake-up socket and threads, and closes
    them when it ends.

    ``signals``, given by a process that runs this consumer and nothing else, are its stop
    signals: at concurrency 1 the handlers then run on ``run()``'s own thread, and a
    handler hung past its TIMEOUT, or past SHUTDOWN_TIMEOUT after a stop, ends the
    process (``stopping.Watchdog``). Without, a hung handler holds a thread, never the
    caller's.
    """

    def __init__(
        self,
        handlers: dict[str, registry.Handler],
        using: str | dict[str, list[str]] = "default",
        concurrency: int = 1,
        batch: int | None = None,
        strategy: str = "auto",
        lease: float | None = None,
        burst: bool = False,
        shutdown_timeout: float | None = None,
        on_progress: Callable[[Progress], None] | None = None,
        progress_interval: float = 5.0,
        discover: Callable[[str], registry.Handler | None] | None = None,
        recycling: Recycling | None = None,
        burst_wait: float = BURST_WAIT,
        signals: StopSignals | None = None,
    ) -> None:
        self.concurrency = concurrency
        self.batch = batch or concurrency
        # With several handler threads the next batch is claimed while one runs, so that
        # no thread waits for a claim's round trip; its leases are renewed meanwhile.
        self.capacity = self.batch * (2 if concurrency > 1 else 1)
        self.strategy = strategy
        self.lease = lease
        # Its own identity, even beside another Worker in this process: one Consumer row each.
        self.identity = store.new_identity()
        placed = {using: list(handlers)} if isinstance(using, str) else using
        self.stations = {
            alias: self._station(alias, {name: handlers[name] for name in names}, discover)
            for alias, names in placed.items()
        }
        self.using = next(iter(self.stations))  # the first database, where one is meant
        self._first_station = 0  # the station to claim from first, in turn
        self.burst = burst
        self.shutdown_timeout = (
            conf.get("SHUTDOWN_TIMEOUT") if shutdown_timeout is None else shutdown_timeout
        )
        self.on_progress = on_progress
        self.progress_interval = progress_interval
        self.stopping = threading.Event()
        self.in_flight = InFlight()
        self._outcomes_arrived = threading.Event()
        # Made by run(), which closes them: the wake-up socket, the threads, the event loop
        # (async handlers'; each starts with the first item it is given).
        self.waiter: Waiter
        self.threads: HandlerThreads
        self.coroutines: EventLoop
        # Each served queue's way to the coroutine function of an item (None: never one).
        self._choosers: dict[str, Callable[[QueueItem], registry.AsyncHandler | None] | None] = {}
        self._idle_wait = FIRST_IDLE_WAIT
        self._last_report = (time.monotonic(), 0)
        # What the last progress report said: an unchanged one is not repeated.
        self._last_shown: tuple[int, int, int, int] | None = None
        # Database errors met by any thread. A restarted server has dropped every
        # connection, the handler threads' idle ones too: a thread that sees this count
        # change checks its own connections before its next item.
        self._database_errors = 0
        self._local = threading.local()
        # How a handler thread runs an item: in a span of its own while traces are
        # recorded (a tracer provider is set up before a consumer starts).
        self._run_item = runner()
        # --max-items, --max-memory, --max-age: why it recycled (None: it did not).
        self.recycler = None if recycling is None else Recycler(recycling)
        self.recycled: str | None = None
        # Each served queue's TIMEOUT (None: no limit), read as its first items come.
        self._timeouts: dict[str, float | None] = {}
        self._watching = False  # some queue has one: the loop looks for overdue handlers
        # The item whose handler ran past its TIMEOUT, which stopped this consumer.
        self.timed_out: QueueItem | None = None
        # A burst run gives up (exits 1) on a database that has not answered for this long;
        # the one it gave up on.
        self.burst_wait = burst_wait
        self.gave_up: str | None = None
        # Handlers on the loop's thread, watched (made by run()); None: on handler threads.
        self.signals = signals
        self.watchdog: Watchdog | None = None

    def _station(
        self,
        alias: str,
        handlers: dict[str, registry.Handler],
        discover: Callable[[str], registry.Handler | None] | None,
    ) -> Station:
        """Database ``alias``'s station: its rotation of ``handlers``' queues, its claims
        of them, and its settler, which claims after settling."""
        probe = partial(store.queues_with_due_items, QueueItem, alias)
        rotation = Rotation(handlers, alias, discover, probe=probe)
        claimer = Claimer(
            rotation.queues,
            pid=self.identity,
            strategy=self.strategy,
            lease=self.lease,
            held=rotation.held,
        )
        settler = Settler(
            alias,
            rotation=rotation,
            claimer=claimer,
            batch=self.batch,
            rides=partial(store.rides_with_claims, self.strategy, alias),
        )
        return Station(alias, rotation, settler)

    @property
    def rotation(self) -> Rotation:
        """The first station's rotation (the only one of a worker on one database)."""
        return self.stations[self.using].rotation

    @property
    def queues(self) -> dict[str, Queue]:
        """Every queue served, by name (on several databases, ``Queue.using`` tells)."""
        return {n: q for s in self.stations.values() for n, q in s.rotation.queues.items()}

    @property
    def processed(self) -> int:
        return sum(station.settler.processed for station in self.stations.values())

    @property
    def failed(self) -> int:
        return sum(station.settler.failed for station in self.stations.values())

    def run(self) -> int:
        """Consume until ``stop()`` (or, with ``burst``, until nothing is due). Exit code."""
        woken_for = [name for s in self.stations.values() for name in s.rotation.woken_for()]
        self.waiter = Waiter(list(self.stations), woken_for)
        if self.stopping.is_set():  # stopped before it had a waiter to interrupt
            self.waiter.interrupt()
        for station in self.stations.values():
            station.housekeeping = self._housekeeping(station, self.waiter.address)
        self.threads = HandlerThreads(self.concurrency, self._run_handlers)
        self.coroutines = EventLoop(
            self.concurrency, self._begin_coroutine, self._run_coroutine, self._report_ended
        )
        if self.signals is not None and self.concurrency == 1:
            self.watchdog = Watchdog(
                due=lambda: bool(self._overdue()),
                take_over=self._take_over,
                stopping=self.stopping,
                shutdown_timeout=self.shutdown_timeout,
                signals=self.signals,
            )
            self._run_item = self.watchdog.watched(self._run_item)
            self.watchdog.start()
        logger.info(
            "consumer %s started: queues %s, batch %d",
            self.identity,
            ", ".join(self._queue_names()) or "(found as items arrive)",
            self.batch,
        )
        try:
            while not self.stopping.is_set():
                if self.recycler is not None and self._recycling_done():
                    break
                if not self._turn():
                    break
                self._report_progress()
        except KeyboardInterrupt:
            pass  # Ctrl-C where no signal handler was installed: stop gracefully
        finally:
            self._shut_down()
            if self.watchdog is not None:
                self.watchdog.close()
        return self._exit_code()

    def _exit_code(self) -> int:
        if self.timed_out is not None:
            return timeouts.ITEM_TIMEOUT_EXIT
        return 0 if self.gave_up is None else 1

    def _overdue(self) -> list[QueueItem]:
        """The items whose handler has run past its TIMEOUT (none unless a queue has one)."""
        return timeouts.overdue(self.in_flight.held()) if self._watching else []

    def _take_over(self, deadline: float | None) -> int:
        """On the watchdog's thread, the loop's held in a handler for good: what the loop
        would have done (a handler past its TIMEOUT stopped; the shutdown, by ``deadline``
        if it has begun) and the exit code it would have returned."""
        if overdue := self._overdue():
            self._stop_overdue(overdue)
            deadline = None  # the shutdown a time limit begins: SHUTDOWN_TIMEOUT from now
        self._shut_down(deadline)
        return self._exit_code()

    def _recycling_done(self) -> bool:
        """Whether a recycling consumer has run every item it claimed: from the turn it
        reaches a limit on, it claims nothing more (``recycled``)."""
        assert self.recycler is not None  # noqa: S101 - asked only with one
        if self.recycled is None and (reason := self.recycler.reason()) is not None:
            self.recycled = reason
            logger.info(
                "recycling (%s): finishing %s", reason, counted(len(self.in_flight), "item")
            )
            if metrics.recorder is not None:
                metrics.recorder.recycling(kind(reason))
        unsettled = any(station.settler.unsettled for station in self.stations.values())
        return self.recycled is not None and not len(self.in_flight) and not unsettled

    def stop(self) -> None:
        """Stop claiming and shut down gracefully (thread- and signal-safe)."""
        self.stopping.set()
        waiter: Waiter | None = getattr(self, "waiter", None)  # None until run() makes it
        if waiter is not None:
            waiter.interrupt()

    def _queue_names(self) -> list[str]:
        """The queues served, each with its database where there are several."""
        several = len(self.stations) > 1
        return [
            f"{name} ({alias})" if several else name
            for alias, station in self.stations.items()
            for name in station.rotation.queues
        ]

    def _housekeeping(self, station: Station, wakeup_address: str) -> Housekeeping:
        """The Consumer row on ``station``'s database, and the thread that keeps it, the
        leases of the items claimed there, and its rescues and purges."""
        consumer = Consumer(
            identity=self.identity,
            host=socket.gethostname(),
            os_pid=os.getpid(),
            queues=list(station.rotation.queues),
            wakeup_address=wakeup_address,
        )
        settler, alias = station.settler, station.alias
        return Housekeeping(
            consumer,
            alias,
            queues=lambda: list(station.rotation.queues.values()),
            held=self.in_flight.held if len(self.stations) == 1 else self.in_flight.on(alias),
            lease=self.lease,
            counters=lambda: (settler.processed, settler.failed),
            stopping=self.stopping,
            on_database_error=lambda: self._database_error(alias),
        )

    def _turn(self) -> bool:
        """One turn of the loop; False when a burst run has drained its queues."""
        if overdue := self._overdue():
            self._stop_overdue(overdue)
            return True
        now = time.monotonic()
        stations = [s for s in self.stations.values() if s.down_until <= now]
        if any(station.rotation.idle for station in stations):
            # Idle queues cost no claim until a wake-up names them: a look, not a wait.
            paused = frozenset(s.alias for s in self.stations.values() if s.down_until > now)
            self._wake(self.waiter.heard(paused))
        claimed = False
        first = self._first_station % len(stations) if stations else 0
        # In turn, so that one database cannot take all the room.
        for position, station in enumerate(stations[first:] + stations[:first], first):
            if self._on_database(station, self._serve):
                claimed = True
                self._first_station = (position + 1) % len(stations)
        down = {s.alias: s.down_until for s in self.stations.values() if s.down_until > now}
        if self.burst and down and self._gives_up(now):
            return False
        if claimed:
            self._idle_wait = FIRST_IDLE_WAIT
        elif len(self.in_flight):
            room = self._next_room(now)
            self._outcomes_arrived.wait(timeout=0.2 if room is None else min(room, 0.2))
            self._outcomes_arrived.clear()
        elif self.burst and not down:
            # Done only after a turn that claimed from every queue, idle ones too.
            if not all(station.had_room for station in stations):
                return True  # a station had no room when it came: its turn again
            if not any(station.rotation.passed_over for station in stations):
                return False
            if (room := self._next_room(now)) is not None:
                self.waiter.wait(room)  # a rate-limited queue's budget is spent meanwhile
            self._wake(None)
        else:  # idle; back to a failed database when its pause is over
            held = [] if (room := self._next_room(now)) is None else [room]
            wait = min([self._idle_wait, *held, *(until - now for until in down.values())])
            woken = self.waiter.wait(max(wait, 0), down=frozenset(down))
            # Woken: claim from the queues named. Timed out: from every one (the idle
            # consumer's poll, for items that came due unannounced).
            self._wake(self.waiter.heard(frozenset(down)) if woken else None)
            self._idle_wait = min(self._idle_wait * 2, conf.get("POLL_INTERVAL"))
        return True

    def _serve(self, station: Station) -> bool:
        """``station``'s turn, one way down: its housekeeping started (once), what its
        handlers came to settled, and the next batch claimed in the same stroke (the
        settler claims, so that a batch's acknowledgement rides with the claim); the
        claimed items go to the handler threads. True if it claimed items."""
        housekeeping = station.housekeeping
        assert housekeeping is not None  # noqa: S101 - made by run()
        if housekeeping.consumer.pk is None:
            housekeeping.start()
        arrived = take_all(station.arrived)
        room = self.capacity - len(self.in_flight)
        station.had_room = room + len(arrived) > 0  # what arrived frees its room
        if not (arrived or room > 0 or station.settler.unsettled):
            return False  # nothing to write, no room to claim
        forget_queries()  # this thread's, before the batch's statements
        claimed: list[QueueItem] = []
        if self.recycled is not None:  # recycling: run what it holds, claim nothing
            settled = station.settler.settle(arrived)
        else:
            if self.recycler is not None:
                station.settler.claim_cap = self.recycler.claims_left()
            # A batch's room without the claim-ahead: a rate-limited queue's claims take
            # no more, so that its items are not claimed a batch before they can start.
            free = self.batch - len(self.in_flight) + len(arrived)
            settled, claimed = station.settler.settle_and_claim(arrived, room=room, free=free)
            if self.recycler is not None:
                self.recycler.claimed += len(claimed)
        self.in_flight.remove(settled)
        if found := station.rotation.found:  # new queues: their wake-ups concern us now
            self.waiter.queues.update(found)
            found.clear()
        if claimed:
            self._dispatch(claimed)
        return bool(claimed)

    def _gives_up(self, now: float) -> bool:
        """Whether a burst run stops, exit 1: a database has not answered for
        ``burst_wait`` seconds (a cron or CI drain must not wait forever)."""
        for station in self.stations.values():
            if station.down_since and now - station.down_since > self.burst_wait:
                logger.error(
                    "database %r has not answered for %.0f s (--burst-wait): this --burst "
                    "run gives up",
                    station.alias,
                    now - station.down_since,
                )
                self.gave_up = station.alias
                return True
        return False

    def _next_room(self, now: float) -> float | None:
        """Seconds until a held queue's rate budget has room (None: none is held)."""
        return min(
            (
                until - now
                for station in self.stations.values()
                for until in station.rotation.held.values()
                if until > now
            ),
            default=None,
        )

    def _wake(self, names: set[str] | None) -> None:
        """Claim from these idle queues again (None: every queue), on any database."""
        for station in self.stations.values():
            station.rotation.wake(names)

    def _on_database(self, station: Station, step: Callable[[Station], bool | None]) -> bool:
        """``step(station)``; a lost connection to its database pauses that station
        (``_recover``) instead of ending the turn for the others. What it returned, or
        False."""
        try:
            done = bool(step(station))
        except DatabaseError as exc:
            self._recover(station, exc)
            return False
        station.backoff = station.down_since = 0.0
        return done

    def _stop_overdue(self, items: list[QueueItem]) -> None:
        """These items' handlers ran past their TIMEOUT: their attempt failed with
        ItemTimeout, and this consumer stops as on SIGTERM, to exit ``ITEM_TIMEOUT_EXIT``
        (a thread that runs one cannot be stopped, nor used again)."""
        self.timed_out = self.timed_out or items[0]
        self.stop()
        outcomes: dict[str, list[Outcome]] = {}
        for item in items:
            limit = self._timeouts[item.queue] or 0.0
            logger.error(
                "%s #%s ran past its TIMEOUT of %g s: its attempt failed (ItemTimeout); "
                "this consumer stops, and exits %d to be started again",
                item.queue,
                item.pk,
                limit,
                timeouts.ITEM_TIMEOUT_EXIT,
            )
            outcome = timeouts.timed_out(item, limit)
            outcomes.setdefault(item._state.db or self.using, []).append(outcome)
            if metrics.recorder is not None:
                metrics.recorder.timed_out(item.queue)
        for alias, settled in outcomes.items():
            self.in_flight.remove(settled)
            self._on_database(self.stations[alias], partial(settle_there, settled))

    def _dispatch(self, items: list[QueueItem]) -> None:
        """Hand the items to the handler threads, in one share per thread, so that a
        thread reports (and the main thread acknowledges) a share at a time; those of
        async handlers to the event loop."""
        if (queue := items[0].queue) not in self._timeouts:  # a claim's are of one queue
            self._timeouts[queue] = conf.queue_option(queue, "TIMEOUT")
            self._watching = self._watching or self._timeouts[queue] is not None
            handle = self.stations[items[0]._state.db or self.using].rotation.handlers[queue]
            self._choosers[queue] = registry.chooser(handle)
        self.in_flight.add(items)
        if (choose := self._choosers[queue]) is not None:
            coroutines = [item for item in items if choose(item) is not None]
            if coroutines:
                self.coroutines.submit(coroutines)
                if len(coroutines) == len(items):
                    return
                items = [item for item in items if choose(item) is None]
        if self.watchdog is not None:  # on this thread: no hand-over, no thread switch
            self._run_handlers(items)
            return
        size = math.ceil(len(items) / self.threads.size)
        for start in range(0, len(items), size):
            self.threads.submit(items[start : start + size])

    def _begin_coroutine(self, item: QueueItem) -> bool:
        """On the event loop, as an item's coroutine starts: False if it was released
        meanwhile (a shutdown). The consumer stops it BLOCKED_LOOP_GRACE past its
        TIMEOUT, by which it should have stopped itself (it did not: the loop is blocked)."""
        if not self.in_flight.start(item):
            return False
        if (limit := self._timeouts.get(item.queue)) is not None:
            timeouts.started(item, limit, time.monotonic(), grace=BLOCKED_LOOP_GRACE)
        return True

    async def _run_coroutine(self, item: QueueItem) -> Outcome:
        choose = self._choosers[item.queue]
        assert choose is not None  # noqa: S101 - only such items come here
        handle = choose(item)
        assert handle is not None  # noqa: S101 - only such items come here
        return await arun_item(handle, item, self._timeouts.get(item.queue))

    def _report_ended(self, outcomes: list[Outcome]) -> None:
        """On the event loop: hand over what coroutines came to, by station."""
        by_station: dict[str, list[Outcome]] = {}
        for outcome in outcomes:
            by_station.setdefault(outcome.item._state.db or self.using, []).append(outcome)
        for alias, ended in by_station.items():
            self._report(self.stations[alias], ended)

    def _run_handlers(self, items: list[QueueItem]) -> None:
        """On a handler thread: run each item's handler and pass on the outcomes."""
        if getattr(self._local, "database_errors", 0) != self._database_errors:
            self._local.database_errors = self._database_errors
            close_broken_connections()
        # A share comes from one claim, so from one station.
        station = self.stations[items[0]._state.db or self.using]
        outcomes, handlers, run = [], station.rotation.handlers, self._run_item
        limits = self._timeouts
        for item in items:
            if self.stopping.is_set():  # the rest go back unstarted (``_shut_down``)
                break
            if self.in_flight.start(item):  # False: released by a shutdown meanwhile
                if (limit := limits.get(item.queue)) is None:
                    outcomes.append(run(handlers[item.queue], item))
                else:
                    timeouts.started(item, limit, time.monotonic())
                    outcomes.append(run(handlers[item.queue], item))
                    timeouts.ended(item)  # not overdue while its outcome waits to be settled
        if outcomes:
            self._report(station, outcomes)  # the share at once: one acknowledgement

    def _report(self, station: Station, outcomes: list[Outcome]) -> None:
        station.arrived.put(outcomes)
        self._outcomes_arrived.set()

    def _recover(self, station: Station, exc: DatabaseError) -> None:
        """A lost connection: log, pause that station (growing, with jitter), reconnect
        when the pause is over.

        Other database errors (a missing table, say) are bugs or setup mistakes: they end
        the consumer with a traceback instead of retrying forever. The pause stays short
        (``RECONNECT_MAX_PAUSE``): a failover's new primary is claimed from at once.
        """
        lost = dialect_for(station.alias).is_disconnect(exc)
        if not lost and not isinstance(exc, (OperationalError, InterfaceError)):
            raise exc
        station.backoff = next_pause(station.backoff, RECONNECT_MAX_PAUSE)
        station.down_until = time.monotonic() + jittered(station.backoff)
        station.down_since = station.down_since or time.monotonic()
        logger.warning(
            "database error, retrying in %.1f s: %s%s",
            station.backoff,
            one_line(exc),
            f" (database {station.alias!r})" if len(self.stations) > 1 else "",
        )
        if lost:  # even a connection still open, to a server now read-only
            drop_connection(station.alias)
        self._database_error(station.alias)

    def _database_error(self, alias: str) -> None:
        """Count the error and drop this thread's connection to ``alias`` if it broke."""
        self._database_errors += 1
        close_if_broken(alias)

    def _report_progress(self) -> None:
        started, processed_then = self._last_report
        elapsed = time.monotonic() - started
        if elapsed < self.progress_interval:
            return
        backlog, exact = self._backlog()
        progress = Progress(
            processed=self.processed,
            failed=self.failed,
            rate=(self.processed - processed_then) / elapsed,
            backlog=backlog,
            in_flight=len(self.in_flight),
            backlog_exact=exact,
        )
        self._last_report = (time.monotonic(), self.processed)
        shown = (progress.processed, progress.failed, progress.backlog, progress.in_flight)
        if shown == self._last_shown:
            return  # an idle consumer says nothing new every few seconds: nothing at all
        self._last_shown = shown
        logger.info(
            "processed %d, failed %d, %.1f/s, backlog %s",
            progress.processed,
            progress.failed,
            progress.rate,
            progress.backlog_text,
        )
        if self.on_progress is not None:
            self.on_progress(progress)

    def _backlog(self) -> tuple[int, bool]:
        """The ready items of the queues served, counted up to BACKLOG_COUNTED_UP_TO each,
        else the database's estimate (and False); -1 if the database failed."""
        total, exact = 0, True
        try:
            for station in self.stations.values():
                counting = dialect_for(station.alias)
                for queue in station.rotation.queues.values():
                    ready = queue.items.filter(status=Status.READY)
                    found = counting.estimated_count(ready, BACKLOG_COUNTED_UP_TO)
                    total += found
                    exact = exact and found <= BACKLOG_COUNTED_UP_TO
        except DatabaseError:
            return -1, True
        return total, exact

    def _shut_down(self, deadline: float | None = None) -> None:
        """Release unstarted items, let running ones finish (by ``deadline``, monotonic;
        None: SHUTDOWN_TIMEOUT from now), mark the Consumer stopped."""
        self.stopping.set()
        if deadline is None:
            deadline = time.monotonic() + self.shutdown_timeout
        self.threads.close()
        try:
            for item in self.in_flight.take_unstarted():
                store.release(item)
            while len(self.in_flight) and time.monotonic() < deadline:
                self._outcomes_arrived.wait(timeout=min(0.2, max(deadline - time.monotonic(), 0)))
                self._outcomes_arrived.clear()
                self._settle_arrived()
            if len(self.in_flight):  # coroutines can be stopped: their items go back READY
                self._release(self.coroutines.abandon(), "cancelled at the shutdown timeout")
                self._settle_arrived()
            if len(self.in_flight) and self.timed_out is not None:
                if overdue := timeouts.overdue(self.in_flight.held()):
                    self._stop_overdue(overdue)  # hung meanwhile: failed as the first
                self._release_running()
            if len(self.in_flight):
                logger.warning(
                    "shutdown timeout: %s left IN_PROGRESS for rescue",
                    counted(len(self.in_flight), "item"),
                )
            for station in self.stations.values():
                if station.housekeeping is not None:
                    station.housekeeping.stop()
        except DatabaseError as exc:
            logger.warning("could not finish the shutdown cleanly: %s", exc)
        finally:
            self.coroutines.close()
            self.waiter.close()
            connections.close_all()
            logger.info("consumer %s stopped", self.identity)

    def _settle_arrived(self) -> None:
        for station in self.stations.values():
            self.in_flight.remove(station.settler.settle(take_all(station.arrived)))

    def _release_running(self) -> None:
        """Stopped by a hung handler, past the shutdown timeout: the items still running go
        back READY, their attempt uncounted (the process ends, and they with it), but
        those of a queue that must not run twice (``RESCUE`` "fail"), left to the rescue."""
        self._release(
            [item for item, _ in self.in_flight.held()], "still running, as this consumer exits"
        )

    def _release(self, items: list[QueueItem], why: str) -> None:
        """Put these items back READY, their attempt uncounted, but those of a queue that
        must not run twice (``RESCUE`` "fail"), left to the rescue; log how many, and why."""
        released = [
            item
            for item in items
            if conf.queue_option(item.queue, "RESCUE") != "fail" and store.release(item)
        ]
        if released:
            logger.warning("released %s %s", counted(len(released), "item"), why)
            self.in_flight.discard(released)


def settle_there(outcomes: list[Outcome], station: Station) -> bool:
    """Settle ``outcomes`` on ``station``'s database (``Worker._on_database``'s step)."""
    return bool(station.settler.settle(outcomes))


def take_all(arrived: queue_module.SimpleQueue[list[Outcome]]) -> list[Outcome]:
    """Every outcome handed over so far, without waiting."""
    taken: list[Outcome] = []
    while True:
        try:
            taken += arrived.get_nowait()
        except queue_module.Empty:
            return taken


class InFlight:
    """Items claimed and not yet settled, shared by the loop, handler threads and housekeeping."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Keyed by the item object itself (the same one goes from claim to settle): its pk
        # is a property call, several per item otherwise.
        self._started: dict[int, tuple[QueueItem, float | None]] = {}

    def __len__(self) -> int:
        return len(self._started)

    def add(self, items: list[QueueItem]) -> None:
        with self._lock:
            for item in items:
                self._started[id(item)] = (item, None)

    def start(self, item: QueueItem) -> bool:
        """Note that the item's handler starts now; False if it was released meanwhile."""
        with self._lock:
            if id(item) not in self._started:
                return False
            self._started[id(item)] = (item, time.monotonic())
            return True

    def remove(self, outcomes: list[Outcome]) -> None:
        """Forget settled items: one lock for the whole batch."""
        if not outcomes:
            return
        with self._lock:
            for outcome in outcomes:
                self._started.pop(id(outcome.item), None)

    def held(self) -> Iterator[tuple[QueueItem, float | None]]:
        with self._lock:
            return iter(list(self._started.values()))

    def on(self, alias: str) -> Callable[[], Iterator[tuple[QueueItem, float | None]]]:
        """``held``, of the items claimed on database ``alias`` only."""

        def held_there() -> Iterator[tuple[QueueItem, float | None]]:
            return (pair for pair in self.held() if pair[0]._state.db == alias)

        return held_there

    def discard(self, items: list[QueueItem]) -> None:
        """Forget these items (released, not settled)."""
        with self._lock:
            for item in items:
                self._started.pop(id(item), None)

    def take_unstarted(self) -> list[QueueItem]:
        """Remove and return the items no handler has started."""
        with self._lock:
            unstarted = [item for item, started in self._started.values() if started is None]
            for item in unstarted:
                del self._started[id(item)]
        return unstarted


class HandlerThreads:
    """``size`` daemon threads running ``run`` on submitted work; each closes its own
    connections when it ends. Daemons, so a hung handler cannot keep the process up
    past the shutdown timeout."""

    def __init__(self, size: int, run: Callable[[list[QueueItem]], None]) -> None:
        self.size = size
        self.run = run
        self.pending: queue_module.SimpleQueue[list[QueueItem] | None] = queue_module.SimpleQueue()
        self.threads = [
            threading.Thread(target=self.serve, name=f"txqueue-handler-{n}", daemon=True)
            for n in range(size)
        ]
        self.started = False

    def submit(self, items: list[QueueItem]) -> None:
        if not self.started:  # a consumer of async handlers only starts none
            self.started = True
            for thread in self.threads:
                thread.start()
        self.pending.put(items)

    def serve(self) -> None:
        try:
            while (items := self.pending.get()) is not None:
                self.run(items)
                forget_queries()
        finally:
            connections.close_all()

    def close(self) -> None:
        """Let each thread finish its current work, then end."""
        for _ in self.threads:
            self.pending.put(None)
