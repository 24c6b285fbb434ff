"""The consumer loop: claim, hand to handler threads, settle; stop gracefully.

The main thread claims and settles: per batch, a claim and one fenced acknowledgement
of the batch's successes, which rides with the next claim where that saves a round
trip or a commit (PostgreSQL: one statement; MySQL and MariaDB: one transaction).
Handlers run on ``concurrency`` threads, so the main thread stays free to enforce the
shutdown timeout; with more than one, the next batch is claimed while one runs. The
``Liveness`` thread keeps the Consumer row, the leases and rescues; ``Settler``
writes outcomes. No SQL here, no argument parsing, no printing: the command does
those and hears about progress through a callback and logging.
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
from dataclasses import dataclass

from django.db import Error as DatabaseError
from django.db import InterfaceError, OperationalError, connections

from . import conf, registry, signals, store
from .api import Queue
from .claims import Resume
from .db import dialect_for
from .execution import (
    Outcome,
    close_broken_connections,
    close_if_broken,
    drop_connection,
    run_handler,
)
from .liveness import Liveness
from .logs import forget_queries, one_line
from .models import Consumer, QueueItem
from .retry import RECONNECT_MAX_PAUSE, jittered, next_pause
from .rotation import Rotation
from .settle import Settler
from .wakeup import Waiter

logger = logging.getLogger(__name__)

FIRST_IDLE_WAIT = 0.05  # seconds; doubles while idle, up to POLL_INTERVAL


@dataclass
class Progress:
    processed: int
    failed: int
    rate: float
    backlog: int
    in_flight: int


class Worker:
    """Consume ``handlers``' queues from database ``using`` until stopped (or drained).

    ``discover``, if given, is asked for a handler for each queue with ready items
    that has none yet (None: not ours), every few seconds (``Rotation``). Every worker
    also runs the ``on_commit`` calls whose committing process did not (``outbox``).
    Making one opens nothing: ``run()`` opens its wake-up socket and threads, and closes
    them when it ends.
    """

    def __init__(
        self,
        handlers: dict[str, registry.Handler],
        using: str = "default",
        concurrency: int = 1,
        batch: int | None = None,
        strategy: str = "auto",
        lease: float | None = None,
        burst: bool = False,
        shutdown_timeout: float | None = None,
        on_progress: Callable[[Progress], None] | None = None,
        progress_interval: float = 5.0,
        discover: Callable[[str], registry.Handler | None] | None = None,
    ) -> None:
        self.rotation = Rotation(handlers, using, discover)
        self.using = using
        self.concurrency = concurrency
        self.batch = batch or concurrency
        # With several handler threads the next batch is claimed while one runs, so that
        # no thread waits for a claim's round trip; its leases are renewed meanwhile.
        self.capacity = self.batch * (2 if concurrency > 1 else 1)
        self.strategy = strategy
        self.lease = lease
        self.burst = burst
        self.shutdown_timeout = (
            conf.get("SHUTDOWN_TIMEOUT") if shutdown_timeout is None else shutdown_timeout
        )
        self.on_progress = on_progress
        self.progress_interval = progress_interval
        # Its own identity, even beside another Worker in this process: one Consumer row each.
        self.identity = store.new_identity()
        self.stopping = threading.Event()
        # Where each queue's next claim starts (``Resume``), made at its first claim.
        self.resumes: dict[str, Resume] = {}
        self.settler = Settler(using)
        self.acks_while_claiming = dialect_for(using).acks_while_claiming
        self.in_flight = InFlight()
        # Made by run(), which closes them: the wake-up socket and the threads.
        self.waiter: Waiter
        self.liveness: Liveness
        self.threads: HandlerThreads
        self._idle_wait = FIRST_IDLE_WAIT
        self._error_backoff = 0.0
        self._last_report = (time.monotonic(), 0)
        # Database errors met by any thread. A restarted server has dropped every
        # connection, the handler threads' idle ones too: a thread that sees this count
        # change checks its own connections before its next item.
        self._database_errors = 0
        self._local = threading.local()

    @property
    def handlers(self) -> dict[str, registry.Handler]:
        return self.rotation.handlers

    @property
    def queues(self) -> dict[str, Queue]:
        return self.rotation.queues

    @property
    def processed(self) -> int:
        return self.settler.processed

    @property
    def failed(self) -> int:
        return self.settler.failed

    def run(self) -> int:
        """Consume until ``stop()`` (or, with ``burst``, until nothing is due). Exit code."""
        self.waiter = Waiter(self.using, self.rotation.woken_for())
        if self.stopping.is_set():  # stopped before it had a waiter to interrupt
            self.waiter.interrupt()
        self.liveness = self._liveness(self.waiter.address)
        self.threads = HandlerThreads(self.concurrency, self._run_handlers)
        logger.info(
            "consumer %s started: queues %s, batch %d",
            self.identity,
            ", ".join(self.queues) or "(found as items arrive)",
            self.batch,
        )
        self.threads.start()
        try:
            while not self.stopping.is_set():
                try:
                    if not self._turn():
                        break
                    self._error_backoff = 0.0
                except DatabaseError as exc:
                    self._recover(exc)
                self._report_progress()
        except KeyboardInterrupt:
            pass  # Ctrl-C where no signal handler was installed: stop gracefully
        finally:
            self._shut_down()
        return 0

    def stop(self) -> None:
        """Stop claiming and shut down gracefully (thread- and signal-safe)."""
        self.stopping.set()
        waiter: Waiter | None = getattr(self, "waiter", None)  # None until run() makes it
        if waiter is not None:
            waiter.interrupt()

    def _liveness(self, wakeup_address: str) -> Liveness:
        consumer = Consumer(
            identity=self.identity,
            host=socket.gethostname(),
            os_pid=os.getpid(),
            queues=list(self.queues),
            wakeup_address=wakeup_address,
        )
        return Liveness(
            consumer,
            self.using,
            queues=lambda: list(self.queues.values()),
            held=self.in_flight.held,
            lease=self.lease,
            counters=lambda: (self.processed, self.failed),
            stopping=self.stopping,
            on_database_error=self._database_error,
        )

    def _turn(self) -> bool:
        """One turn of the loop; False when a burst run has drained its queues."""
        forget_queries()
        self.liveness.start()
        for name in self.rotation.discover_new():
            self.waiter.queues.add(name)
        # Where it saves a round trip or a commit, the successes' acknowledgement rides
        # with the claim.
        self.in_flight.remove(self.settler.settle(hold=self.acks_while_claiming))
        free = min(self.batch, self.capacity - len(self.in_flight) + self.settler.holding)
        claimed = self._claim(free) if free > 0 else []
        if self.settler.holding:  # no claim ran to take it
            self.in_flight.remove(self.settler.settle())
        if claimed:
            self._idle_wait = FIRST_IDLE_WAIT
            self._dispatch(claimed)
        elif len(self.in_flight):
            self.settler.wait(timeout=0.2)
        elif self.burst:
            return False
        else:
            self.waiter.wait(self._idle_wait)
            self._idle_wait = min(self._idle_wait * 2, conf.get("POLL_INTERVAL"))
        return True

    def _claim(self, limit: int) -> list[QueueItem]:
        """Claim from the queues in the rotation's order (``Rotation``)."""
        return self.rotation.first_to_give(lambda name: self._claim_from(name, limit))

    def _claim_from(self, name: str, limit: int) -> list[QueueItem]:
        queue, held = self.queues[name], self.settler.held_ack()
        if name not in self.resumes:
            self.resumes[name] = Resume(queue.claims)
        acknowledged, items = self.resumes[name].ack_and_claim(
            *(held or (0, {})), limit, pid=self.identity, strategy=self.strategy, lease=self.lease
        )
        if held is not None:
            self.in_flight.remove(self.settler.acknowledged(acknowledged))
        return items

    def _dispatch(self, items: list[QueueItem]) -> None:
        """Hand the items to the handler threads, in one share per thread, so that a
        thread reports (and the main thread acknowledges) a share at a time."""
        self.in_flight.add(items)
        if signals.heard(signals.item_claimed, QueueItem):  # else a call per item for nothing
            for item in items:
                signals.item_claimed.send(sender=QueueItem, item=item)
        size = math.ceil(len(items) / self.threads.size)
        for start in range(0, len(items), size):
            self.threads.submit(items[start : start + size])

    def _run_handlers(self, items: list[QueueItem]) -> None:
        """On a handler thread: run each item's handler and pass on the outcomes."""
        if getattr(self._local, "database_errors", 0) != self._database_errors:
            self._local.database_errors = self._database_errors
            close_broken_connections()
        outcomes, handlers = [], self.rotation.handlers
        for item in items:
            if self.in_flight.start(item):  # False: released by a shutdown meanwhile
                outcomes.append(run_handler(handlers[item.queue], item))
            if self.stopping.is_set() and outcomes:  # stopping: report each as it ends
                self.settler.put(outcomes)
                outcomes = []
        if outcomes:
            self.settler.put(outcomes)  # the share at once: one acknowledgement

    def _recover(self, exc: DatabaseError) -> None:
        """A lost connection: log, back off (with jitter), reconnect on the next turn.

        Other database errors (a missing table, say) are bugs or setup mistakes: they end
        the consumer with a traceback instead of retrying forever. The pause stays short
        (``RECONNECT_MAX_PAUSE``): a failover's new primary is claimed from at once.
        """
        lost = dialect_for(self.using).is_disconnect(exc)
        if not lost and not isinstance(exc, (OperationalError, InterfaceError)):
            raise exc
        self._error_backoff = next_pause(self._error_backoff, RECONNECT_MAX_PAUSE)
        logger.warning(
            "database error, retrying in %.1f s: %s", self._error_backoff, one_line(exc)
        )
        if lost:  # even a connection still open, to a server now read-only
            drop_connection(self.using)
        self._database_error()
        self.stopping.wait(jittered(self._error_backoff))

    def _database_error(self) -> None:
        """Count the error and drop this thread's connection if it broke."""
        self._database_errors += 1
        close_if_broken(self.using)

    def _report_progress(self) -> None:
        started, processed_then = self._last_report
        elapsed = time.monotonic() - started
        if elapsed < self.progress_interval:
            return
        try:
            backlog = sum(queue.approximate_count() for queue in self.queues.values())
        except DatabaseError:
            backlog = -1
        progress = Progress(
            processed=self.processed,
            failed=self.failed,
            rate=(self.processed - processed_then) / elapsed,
            backlog=backlog,
            in_flight=len(self.in_flight),
        )
        self._last_report = (time.monotonic(), self.processed)
        logger.info(
            "processed %d, failed %d, %.1f/s, backlog %d",
            progress.processed,
            progress.failed,
            progress.rate,
            progress.backlog,
        )
        if self.on_progress is not None:
            self.on_progress(progress)

    def _shut_down(self) -> None:
        """Release unstarted items, let running ones finish, mark the Consumer stopped."""
        self.stopping.set()
        deadline = time.monotonic() + self.shutdown_timeout
        self.threads.close()
        try:
            for item in self.in_flight.take_unstarted():
                store.release(item)
            while len(self.in_flight) and time.monotonic() < deadline:
                self.settler.wait(timeout=min(0.2, max(deadline - time.monotonic(), 0)))
                self.in_flight.remove(self.settler.settle())
            if len(self.in_flight):
                logger.warning(
                    "shutdown timeout: %d items left IN_PROGRESS for rescue", len(self.in_flight)
                )
            self.liveness.stop()
        except DatabaseError as exc:
            logger.warning("could not finish the shutdown cleanly: %s", exc)
        finally:
            self.waiter.close()
            connections.close_all()
            logger.info("consumer %s stopped", self.identity)


class InFlight:
    """Items claimed and not yet settled, shared by the loop, handler threads and liveness."""

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

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def submit(self, items: list[QueueItem]) -> None:
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
