"""The consumer: claim, run, acknowledge; heartbeat, renew leases, rescue; stop gracefully.

One main thread claims and acknowledges (two statements per batch: the claim and one
fenced acknowledgement of the batch's successes); handlers run inline (concurrency 1)
or on a small pool of threads, each with its own Django connections. A heartbeat
thread keeps the ``Consumer`` row fresh, renews the leases of in-flight items and
rescues stuck ones. No SQL here, no argument parsing, no printing: the command does
those and hears about progress through a callback and logging.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue as queue_module
import random
import socket
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.db import Error as DatabaseError
from django.db import InterfaceError, OperationalError, connections
from django.db.models.functions import Now

from . import conf, signals
from .api import Queue
from .models import Consumer, QueueItem, Status, check_json, new_identity
from .registry import Handler
from .wakeup import Waiter

logger = logging.getLogger(__name__)

FIRST_IDLE_WAIT = 0.05  # seconds; doubles while idle, up to POLL_INTERVAL
MAX_ERROR_BACKOFF = 30.0


@dataclass
class Outcome:
    """What running one item's handler came to."""

    item: QueueItem
    result: Any = None
    error: str | None = None
    retry: bool = True
    duration: float = 0.0


@dataclass
class Progress:
    processed: int
    failed: int
    rate: float
    backlog: int
    in_flight: int


@dataclass
class InFlight:
    item: QueueItem
    started: float | None = None  # monotonic time its handler started


@dataclass
class Worker:
    """Consume ``handlers``' queues from database ``using`` until stopped (or drained)."""

    handlers: dict[str, Handler]
    using: str = "default"
    concurrency: int = 1
    batch: int | None = None
    strategy: str = "auto"
    lease: float | None = None
    burst: bool = False
    shutdown_timeout: float | None = None
    on_progress: Callable[[Progress], None] | None = None
    progress_interval: float = 5.0

    processed: int = field(default=0, init=False)
    failed: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.queues = list(self.handlers)
        self.queue_objects = {name: Queue(name, using=self.using) for name in self.queues}
        self.batch = self.batch or self.concurrency
        # Its own identity, even beside another Worker in this process: one Consumer row each.
        self.identity = new_identity()
        self.stopping = threading.Event()
        self.in_flight: dict[int, InFlight] = {}
        self.lock = threading.Lock()
        self.results: queue_module.SimpleQueue[Outcome] = queue_module.SimpleQueue()
        self.unsettled: list[Outcome] = []
        self.consumer: Consumer | None = None
        self.next_queue = 0
        self.idle_wait = FIRST_IDLE_WAIT
        self.error_backoff = 0.0
        self.pool: HandlerThreads | None = None
        # Database errors the loop and the heartbeat have met. A restarted server has dropped
        # every connection, the handler threads' idle ones too: a thread that sees this count
        # change checks its own connections before its next item.
        self.database_errors = 0
        self.local = threading.local()

    # -- the loop ----------------------------------------------------------------------

    def run(self) -> int:
        """Consume until ``stop()`` (or, with ``burst``, until nothing is due). Exit code."""
        self.waiter = Waiter(self.using, self.queues)
        if self.concurrency > 1:
            self.pool = HandlerThreads(self.concurrency, self.run_one)
        heartbeat = threading.Thread(target=self.heartbeat_loop, name="txqueue-heartbeat")
        logger.info(
            "consumer %s started: queues %s, concurrency %d, batch %d",
            self.identity,
            ", ".join(self.queues),
            self.concurrency,
            self.batch,
        )
        self.last_report = (time.monotonic(), 0)
        try:
            while not self.stopping.is_set():
                try:
                    if not self.step(heartbeat):
                        break
                    self.error_backoff = 0.0
                except (OperationalError, InterfaceError) as exc:
                    self.recover(exc)
                self.report_progress()
        finally:
            self.shut_down(heartbeat)
        return 0

    def step(self, heartbeat: threading.Thread) -> bool:
        """One turn of the loop; False when a burst run has drained its queues."""
        if self.consumer is None:
            self.register()
            heartbeat.start()
        self.settle()
        free = self.batch - len(self.in_flight)  # type: ignore[operator]
        claimed = self.claim(free) if free > 0 else []
        if claimed:
            self.idle_wait = FIRST_IDLE_WAIT
            self.dispatch(claimed)
        elif self.in_flight:
            self.await_result(timeout=0.2)
        elif self.burst:
            return False
        else:
            self.waiter.wait(self.idle_wait)
            self.idle_wait = min(self.idle_wait * 2, conf.get("POLL_INTERVAL"))
        return True

    def claim(self, limit: int) -> list[QueueItem]:
        """Claim from the queues in turn, so that a busy queue cannot starve the others."""
        for offset in range(len(self.queues)):
            name = self.queues[(self.next_queue + offset) % len(self.queues)]
            items = self.queue_objects[name].claim(
                limit, pid=self.identity, strategy=self.strategy, lease=self.lease
            )
            if items:
                self.next_queue = (self.next_queue + offset + 1) % len(self.queues)
                return items
        return []

    def dispatch(self, items: list[QueueItem]) -> None:
        with self.lock:
            for item in items:
                self.in_flight[item.pk] = InFlight(item)
        for item in items:
            signals.item_claimed.send(sender=QueueItem, item=item)
        if self.pool is not None:
            for item in items:
                self.pool.submit(item)
            return
        for item in items:
            if self.stopping.is_set():
                break  # the rest is released at shutdown
            self.run_one(item)
        self.settle()

    def run_one(self, item: QueueItem) -> None:
        """Run one handler (on whichever thread) and queue its outcome for the main loop."""
        started = time.monotonic()
        with self.lock:
            entry = self.in_flight.get(item.pk)
            if entry is None:
                return  # released by a shutdown before any thread started it
            entry.started = started
        if getattr(self.local, "database_errors", 0) != self.database_errors:
            self.local.database_errors = self.database_errors
            close_broken_connections()
        outcome = Outcome(item)
        try:
            result = self.handlers[item.queue](item)
        except Exception:
            outcome.error = traceback.format_exc()
            close_broken_connections(failed_only=True)  # else every later item fails too
        else:
            try:
                if result is not None:
                    check_json(result, f"the result of the {item.queue!r} handler")
                outcome.result = result
            except TypeError as exc:
                outcome.error, outcome.retry = str(exc), False  # retrying cannot help
        outcome.duration = time.monotonic() - started
        self.results.put(outcome)

    def await_result(self, timeout: float) -> None:
        with contextlib.suppress(queue_module.Empty):
            self.unsettled.append(self.results.get(timeout=timeout))

    def settle(self) -> None:
        """Acknowledge finished items: one fenced UPDATE per claim for the successes.

        An outcome leaves ``unsettled`` only once the database has it, so after a lost
        connection the rest is settled on a later turn.
        """
        while True:
            try:
                self.unsettled.append(self.results.get_nowait())
            except queue_module.Empty:
                break
        by_claim: dict[int, list[Outcome]] = {}
        for outcome in self.unsettled:
            if outcome.error is None:
                by_claim.setdefault(outcome.item.claim_token or 0, []).append(outcome)
        for token, group in by_claim.items():
            results = {outcome.item.pk: outcome.result for outcome in group}
            acknowledged = QueueItem.objects.using(self.using).ack_many(results, token)
            if acknowledged < len(results):
                logger.warning(
                    "%d of %d acknowledgements refused: their claims were taken over",
                    len(results) - acknowledged,
                    len(results),
                )
            self.finish(group)
        for outcome in [o for o in self.unsettled if o.error is not None]:
            self.settle_failure(outcome)
            self.finish([outcome])

    def settle_failure(self, outcome: Outcome) -> None:
        item = outcome.item
        final = not outcome.retry or item.attempts >= item.max_attempts
        if outcome.retry:
            item.retry(outcome.error)
        else:
            item.fail(outcome.error)
        logger.warning(
            "%s #%s failed (attempt %d of %d)%s: %s",
            item.queue,
            item.pk,
            item.attempts,
            item.max_attempts,
            "" if final else ", will retry",
            (outcome.error or "").strip().splitlines()[-1],
        )

    def finish(self, outcomes: list[Outcome]) -> None:
        with self.lock:
            for outcome in outcomes:
                self.in_flight.pop(outcome.item.pk, None)
        settled = {id(outcome) for outcome in outcomes}
        self.unsettled = [o for o in self.unsettled if id(o) not in settled]
        for outcome in outcomes:
            if outcome.error is None:
                self.processed += 1
                signals.item_done.send(
                    sender=QueueItem,
                    item=outcome.item,
                    result=outcome.result,
                    duration=outcome.duration,
                )
            else:
                self.failed += 1
                signals.item_failed.send(
                    sender=QueueItem,
                    item=outcome.item,
                    error=outcome.error,
                    will_retry=outcome.item.status == Status.READY,
                    duration=outcome.duration,
                )

    # -- registration, heartbeat, leases, rescue ------------------------------------

    def register(self) -> None:
        """A Consumer row for this process start: its identity is the items' pid."""
        self.consumer = Consumer.objects.using(self.using).create(
            identity=self.identity,
            host=socket.gethostname(),
            os_pid=os.getpid(),
            queues=self.queues,
            wakeup_address=self.waiter.address,
        )

    def heartbeat_loop(self) -> None:
        """Every HEARTBEAT_INTERVAL: heartbeat, renew in-flight leases, and now and then rescue."""
        next_rescue = time.monotonic() + random.uniform(0, conf.get("RESCUE_INTERVAL"))
        try:
            while not self.stopping.wait(conf.get("HEARTBEAT_INTERVAL")):
                try:
                    self.beat()
                    self.renew_leases()
                    if time.monotonic() >= next_rescue:
                        self.rescue()
                        next_rescue = time.monotonic() + conf.get("RESCUE_INTERVAL")
                except DatabaseError as exc:
                    self.database_errors += 1
                    logger.warning("heartbeat failed, will retry: %s", exc)
                    close_if_broken(self.using)
        finally:
            connections.close_all()

    def beat(self) -> None:
        Consumer.objects.using(self.using).filter(identity=self.identity).update(
            last_heartbeat_at=Now(), processed=self.processed, failed=self.failed
        )

    def renew_leases(self) -> None:
        """Extend the leases of items still being worked on (not those past TIMEOUT)."""
        now = time.monotonic()
        by_lease: dict[timedelta, dict[int, int]] = {}
        with self.lock:
            running = list(self.in_flight.values())
        for entry in running:
            item = entry.item
            timeout = conf.queue_option(item.queue, "TIMEOUT")
            if timeout is not None and entry.started is not None and now - entry.started > timeout:
                continue  # hung or too slow: let the lease lapse so it can be rescued
            lease = conf.to_timedelta(
                self.lease if self.lease is not None else conf.queue_option(item.queue, "LEASE"),
                "lease",
            )
            by_lease.setdefault(lease, {})[item.pk] = item.claim_token  # type: ignore[assignment]
        for lease, tokens in by_lease.items():
            QueueItem.objects.using(self.using).renew_leases(tokens, lease)

    def rescue(self) -> None:
        rescued = sum(queue.requeue_stuck() for queue in self.queue_objects.values())
        if rescued:
            logger.warning("rescued %d stuck items", rescued)

    # -- faults, progress, stopping -------------------------------------------------

    def recover(self, exc: DatabaseError) -> None:
        """A lost connection: log, back off (with jitter), reconnect on the next turn.

        Other database errors (a missing table, say) are bugs or setup mistakes: they end
        the consumer with a traceback instead of retrying forever.
        """
        self.error_backoff = min(max(self.error_backoff * 2, 0.5), MAX_ERROR_BACKOFF)
        self.database_errors += 1
        logger.warning(
            "database error, retrying in %.1f s: %s", self.error_backoff, str(exc).strip()
        )
        close_if_broken(self.using)
        self.stopping.wait(self.error_backoff * random.uniform(0.8, 1.2))

    def report_progress(self) -> None:
        started, processed_then = self.last_report
        elapsed = time.monotonic() - started
        if elapsed < self.progress_interval:
            return
        try:
            backlog = sum(queue.approximate_count() for queue in self.queue_objects.values())
        except DatabaseError:
            backlog = -1
        progress = Progress(
            processed=self.processed,
            failed=self.failed,
            rate=(self.processed - processed_then) / elapsed,
            backlog=backlog,
            in_flight=len(self.in_flight),
        )
        self.last_report = (time.monotonic(), self.processed)
        logger.info(
            "processed %d, failed %d, %.1f/s, backlog %d",
            progress.processed,
            progress.failed,
            progress.rate,
            progress.backlog,
        )
        if self.on_progress is not None:
            self.on_progress(progress)

    def stop(self) -> None:
        """Ask the loop to stop claiming and shut down gracefully (thread- and signal-safe)."""
        self.stopping.set()
        if hasattr(self, "waiter"):
            self.waiter.interrupt()

    def shut_down(self, heartbeat: threading.Thread) -> None:
        """Release unstarted items, let running ones finish, mark the Consumer stopped."""
        self.stopping.set()
        timeout = self.shutdown_timeout
        if timeout is None:
            timeout = conf.get("SHUTDOWN_TIMEOUT")
        deadline = time.monotonic() + timeout
        if self.pool is not None:
            self.pool.close()
        try:
            self.release_unstarted()
            while self.in_flight and time.monotonic() < deadline:
                self.await_result(timeout=min(0.2, max(deadline - time.monotonic(), 0)))
                self.settle()
            self.settle()
            if self.in_flight:
                logger.warning(
                    "shutdown timeout: %d items left IN_PROGRESS for rescue", len(self.in_flight)
                )
            if self.consumer is not None:
                Consumer.objects.using(self.using).filter(identity=self.identity).update(
                    stopped_at=Now(), processed=self.processed, failed=self.failed
                )
        except DatabaseError as exc:
            logger.warning("could not finish the shutdown cleanly: %s", exc)
        finally:
            if heartbeat.is_alive():
                heartbeat.join(timeout=5)
            self.waiter.close()
            connections.close_all()
            logger.info("consumer %s stopped", self.identity)

    def release_unstarted(self) -> None:
        """Put back items claimed but not started: READY for others, attempt not counted."""
        with self.lock:
            unstarted = [e.item for e in self.in_flight.values() if e.started is None]
            for item in unstarted:
                del self.in_flight[item.pk]
        for item in unstarted:
            item.release()


def close_if_broken(alias: str) -> None:
    """Drop a connection that can no longer be used; Django reconnects on next use."""
    connection = connections[alias]
    try:
        if connection.connection is not None and not connection.is_usable():
            connection.close()
    except DatabaseError:
        connection.connection = None


def close_broken_connections(failed_only: bool = False) -> None:
    """``close_if_broken`` for each connection this thread has opened; with ``failed_only``,
    only for those that have raised an error (no round trip for the others)."""
    for connection in connections.all(initialized_only=True):
        if not failed_only or connection.errors_occurred:
            close_if_broken(connection.alias)


class HandlerThreads:
    """N threads running handlers; each closes its own connections when it ends."""

    def __init__(self, size: int, run: Callable[[QueueItem], None]) -> None:
        self.run = run
        self.pending: queue_module.SimpleQueue[QueueItem | None] = queue_module.SimpleQueue()
        self.threads = [
            threading.Thread(target=self.serve, name=f"txqueue-handler-{n}", daemon=True)
            for n in range(size)
        ]
        for thread in self.threads:
            thread.start()

    def submit(self, item: QueueItem) -> None:
        self.pending.put(item)

    def serve(self) -> None:
        try:
            while (item := self.pending.get()) is not None:
                self.run(item)
        finally:
            connections.close_all()

    def close(self) -> None:
        """Let each thread finish its current item, then end."""
        for _ in self.threads:
            self.pending.put(None)
