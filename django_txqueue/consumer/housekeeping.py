"""A consumer's housekeeping thread: its jobs on their timers, beside the loop.

- ``heartbeat``: the ``Consumer`` row, the leases of held items and the cancellation
  requests, every heartbeat tick;
- ``rescue``: stuck items of its queues, every ``RESCUE_INTERVAL`` from start-up;
- ``purge``: finished items past their ``RETENTION``, every ``PURGE_INTERVAL`` from
  start-up, for at most ``PURGE_RUN`` and never past the next heartbeat;
- the ticks of its queues' ``SCHEDULE`` entries (``schedule.Scheduler``), on a timer that
  wakes at each entry's next tick.

A failed job is logged and tried again soon; none stops the heartbeat.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from django.db import DatabaseError, connections

from .. import conf, store
from ..api import Queue
from ..models import Consumer
from ..observe.logs import forget_queries
from ..schedule import Scheduler
from . import heartbeat, purge, rescue
from .heartbeat import Held

logger = logging.getLogger(__name__)

# After a failed tick (the database is away), try again this soon.
RETRY_PAUSE = 0.5
# A purge deletes for at most this many seconds at a time, and never past a heartbeat, so
# a backlog (the first purge after an upgrade) is worked off in short bursts.
PURGE_RUN = 1.0


class Housekeeping:
    """The thread that runs a consumer's jobs on one database, from the first ``start()``
    (which registers its Consumer row) to ``stop()`` (which marks it stopped)."""

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
        self.thread = threading.Thread(target=self._run, name="txqueue-housekeeping", daemon=True)
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
        return heartbeat.interval(self.queues(), self.lease)

    def _beat(self) -> None:
        heartbeat.beat(self.consumer, self.queues(), self.counters())

    def _renew_leases(self) -> None:
        heartbeat.renew_leases(self.using, self.held, self.lease)

    def _read_cancel_requests(self) -> None:
        heartbeat.read_cancel_requests(self.using, self.held)

    def _rescue(self) -> None:
        rescue.rescue_stuck(self.using, self.queues())
        held = [item.pk for item, _ in self.held()]
        rescue.release_lost_claims(self.using, self.consumer.identity, held)

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
        return purge.purge_finished(self.using, self.queues(), until)
