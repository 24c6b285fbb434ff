"""A consumer's liveness thread: its ``Consumer`` row, its leases, and rescues.

- Heartbeat: the row's ``last_heartbeat_at`` every ``HEARTBEAT_INTERVAL``, so that others
  can tell this consumer is alive.
- Lease renewal, on the same tick, for the items whose handlers are still within their
  queue's ``TIMEOUT``. The tick is also at most a third of the shortest lease this
  consumer gives, so that no rescue takes an item from a live consumer. After it, one read
  of which held items were asked to stop (``QueueItem.cancel_requested()``).
- Rescue of the stuck items of its queues on a timer of its own, every
  ``RESCUE_INTERVAL`` from start-up: an item whose consumer died is READY again within
  its lease plus ``RESCUE_INTERVAL`` of the death, while any consumer of its queue runs.
- Purge, every ``PURGE_INTERVAL`` from start-up, of its queues' DONE, FAILED and CANCELLED items
  finished over their ``RETENTION`` ago, and of the ``once()`` records older than the
  longest retention. One consumer of a database purges at a time (a lock it only tries,
  so the others skip), in batches, for at most ``PURGE_RUN`` and never past its next
  heartbeat; what is left waits for the next run, right after that heartbeat. On
  PostgreSQL the lock is its transaction's, and the run is that one transaction, so
  that a transaction pool (PgBouncer) cannot separate the lock from its release.
- Periodic items (``schedule.py``): the ticks of the ``SCHEDULE`` entries of its queues,
  on a timer of its own that wakes at each entry's next tick.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta

from django.db import DatabaseError, connections

from . import conf, metrics, store
from .api import Queue
from .logs import forget_queries
from .models import Consumer, Effect, QueueItem
from .schedule import Scheduler

logger = logging.getLogger(__name__)

# After a failed tick (the database is away), try again this soon.
RETRY_PAUSE = 0.5
# A claim of ours older than this that we do not hold lost its answer on the way back.
LOST_CLAIM_AGE = timedelta(seconds=10)
# A purge deletes for at most this many seconds at a time, and never past a heartbeat, so
# a backlog (the first purge after an upgrade) is worked off in short bursts.
PURGE_RUN = 1.0

# (item, monotonic time its handler started or None) for each item in flight.
Held = Callable[[], Iterable[tuple[QueueItem, "float | None"]]]


class Liveness:
    def __init__(
        self,
        consumer: Consumer,
        using: str,
        *,
        queues: Callable[[], Iterable[Queue]],
        held: Held,
        lease: float | None,
        counters: Callable[[], tuple[int, int]],
        stopping: threading.Event,
        on_database_error: Callable[[], None],
    ) -> None:
        self.consumer = consumer
        self.using = using
        self.queues = queues
        self.held = held
        self.lease = lease
        self.counters = counters
        self.stopping = stopping
        self.on_database_error = on_database_error
        self.thread = threading.Thread(target=self._run, name="txqueue-liveness", daemon=True)
        self.scheduler = Scheduler(using)

    def start(self) -> None:
        """Register the Consumer row and start the thread (once)."""
        if self.consumer.pk is not None:
            return
        store.register(self.consumer, self.using)
        self.thread.start()

    def stop(self) -> None:
        """Wait for the thread, then mark the Consumer row stopped."""
        if self.thread.is_alive():
            self.thread.join(timeout=5)
        if self.consumer.pk is not None:
            processed, failed = self.counters()
            store.stop(self.consumer, processed=processed, failed=failed)

    def _run(self) -> None:
        next_beat = next_rescue = next_purge = next_tick = time.monotonic()
        try:
            while not self.stopping.wait(
                max(min(next_beat, next_rescue, next_purge, next_tick) - time.monotonic(), 0)
            ):
                now = time.monotonic()
                forget_queries()
                try:
                    if now >= next_beat:
                        next_beat = now + self._tick()
                        self._beat()
                        self._renew_leases()
                        self._read_cancel_requests()
                    if now >= next_rescue:
                        next_rescue = now + conf.get("RESCUE_INTERVAL")
                        self._rescue()
                except DatabaseError as exc:
                    logger.warning("heartbeat failed, will retry: %s", exc)
                    self.on_database_error()  # in this thread: checks this thread's connection
                    next_beat = min(next_beat, now + RETRY_PAUSE)
                    next_rescue = min(next_rescue, now + RETRY_PAUSE)
                    continue
                if now >= next_tick:
                    next_tick = time.monotonic() + self._schedule_safely()
                if now >= next_purge:
                    next_purge = now + conf.get("PURGE_INTERVAL")
                    until = min(next_beat, time.monotonic() + PURGE_RUN)
                    if not self._purge_safely(until):
                        next_purge = next_beat  # cut short: go on after the heartbeat
        finally:
            connections.close_all()

    def _tick(self) -> float:
        """Seconds to the next heartbeat: HEARTBEAT_INTERVAL, or a third of the shortest
        lease this consumer gives, whichever is shorter."""
        leases = [self._lease(queue.name) for queue in self.queues()]
        shortest = min(leases, default=timedelta.max).total_seconds()
        return float(min(conf.get("HEARTBEAT_INTERVAL"), shortest / 3))

    def _lease(self, queue: str) -> timedelta:
        return store.lease_of(queue, self.lease)

    def _beat(self) -> None:
        processed, failed = self.counters()
        queues = [queue.name for queue in self.queues()]
        store.beat(self.consumer, processed=processed, failed=failed, queues=queues)

    def _renew_leases(self) -> None:
        """Extend the leases of items still being worked on (not those past TIMEOUT)."""
        now = time.monotonic()
        by_lease: dict[timedelta, dict[int, int]] = {}
        for item, started in self.held():
            timeout = conf.queue_option(item.queue, "TIMEOUT")
            if timeout is not None and started is not None and now - started > timeout:
                continue  # hung or too slow: let the lease lapse so it can be rescued
            by_lease.setdefault(self._lease(item.queue), {})[item.pk] = item.claim_token  # type: ignore[assignment]
        for lease, tokens in by_lease.items():
            store.renew_leases(QueueItem, self.using, tokens, lease)

    def _read_cancel_requests(self) -> None:
        """After the renewal, one read of which held items were asked to stop; their
        handlers' instances learn it (``QueueItem.cancel_requested()``), with no query
        of theirs. Nothing held, nothing read."""
        held = {item.pk: item for item, _ in self.held()}
        tokens = {pk: item.claim_token for pk, item in held.items() if item.claim_token}
        asked = QueueItem.objects.using(self.using).cancel_requests(tokens)
        for pk, requested_at in asked.items():
            held[pk].cancel_requested_at = requested_at

    def _rescue(self) -> None:
        queues = {queue.name: queue for queue in self.queues()}
        # One look at which of them have stuck items (IN_PROGRESS rows are few), then an
        # UPDATE for each of those (each with its RESCUE setting), not one per queue: a
        # consumer serving 50 queues ran 50 every RESCUE_INTERVAL.
        stuck = QueueItem.objects.using(self.using).filter(queue__in=list(queues)).stuck()
        names = stuck.order_by().values_list("queue", flat=True).distinct()
        by_queue = {name: queues[name].requeue_stuck() for name in set(names)}
        rescued = sum(by_queue.values())
        if rescued and metrics.recorder is not None:
            for name, count in by_queue.items():
                metrics.recorder.rescued_items(name, count)
        if rescued:
            logger.warning("rescued %d stuck items", rescued)
        held = [item.pk for item, _ in self.held()]
        lost = store.release_lost(
            QueueItem, self.using, self.consumer.identity, held, LOST_CLAIM_AGE
        )
        if lost:
            logger.warning("released %d items claimed by a claim whose answer was lost", lost)

    def _schedule_safely(self) -> float:
        """Enqueue the due ticks of its queues' ``SCHEDULE`` entries; seconds until the
        next. An error is logged and the look tried again soon: its ticks are not lost."""
        try:
            return self.scheduler.look([queue.name for queue in self.queues()])
        except DatabaseError as exc:
            logger.warning("schedule failed, will retry: %s", exc)
            self.on_database_error()
            return RETRY_PAUSE
        except Exception as exc:  # a setting the system checks would refuse: not so often
            logger.warning("schedule failed, will retry: %s", exc)
            return float(conf.get("HEARTBEAT_INTERVAL"))

    def _purge_safely(self, until: float) -> bool:
        """``_purge``, with any error logged: purging is housekeeping, never a reason to
        stop heartbeating. Returns False if the purge was cut short at ``until``."""
        try:
            return self._purge(until)
        except Exception as exc:
            logger.warning("purge failed, will retry in %s s: %s", conf.get("PURGE_INTERVAL"), exc)
            if isinstance(exc, DatabaseError):
                self.on_database_error()
            return True

    def _purge(self, until: float) -> bool:
        """Delete the finished items of its queues past their RETENTION, then the once()
        records past the longest, if no other consumer of the database is purging. With
        nothing kept for a limited time, no lock is taken either."""
        # The queues kept alike purged together: one statement per batch for them all,
        # not one per queue (a consumer serving 50 queues ran 50 at start-up).
        purged: dict[timedelta, list[str]] = {}
        for queue in self.queues():
            if (retention := conf.retention(queue.name)) is not None:
                purged.setdefault(retention, []).append(queue.name)
        kept_for = conf.effect_retention()
        if not purged and kept_for is None:
            return True
        with store.try_lock(self.using, store.PURGE_LOCK) as mine:
            if not mine:
                return True
            items = effects = 0
            for retention, names in purged.items():
                finished = QueueItem.objects.using(self.using).filter(queue__in=names)
                items += store.purge(finished, retention, until=until)
                if time.monotonic() >= until:
                    break  # the others next time (each purge does a batch at least)
            if kept_for is not None and time.monotonic() < until:
                effects = store.purge_effects(
                    Effect.objects.using(self.using), kept_for, until=until
                )
        if items or effects:
            logger.info("purged %d finished items and %d once() records", items, effects)
        return time.monotonic() < until
