"""Settling what handlers came to: one fenced acknowledgement per claim for the
successes, a retry or a failure for each error, then the signals and counters.

Handler threads ``put`` outcomes; the consumer's main thread calls ``settle()``, so
every write happens on one thread and connection. An outcome leaves ``unsettled``
only once the database has it: after a lost connection the rest is settled on a
later turn, and what was settled before the error is returned by that later call (the
consumer's in-flight list forgets an item only when told it is settled).

An outcome the database failed (``Outcome.lost``: a lost connection, a refused
transaction) is released: READY again at once, no attempt counted.
"""

from __future__ import annotations

import contextlib
import logging
import queue

from .. import signals, store
from ..models import QueueItem
from ..observe import metrics
from ..observe.logs import about
from ..status import Status
from .execution import Outcome

# The logger name docs/tracing.md documents (and LOGGING settings name), kept from before
# this module moved into consumer/.
logger = logging.getLogger("django_txqueue.settle")


def acknowledgement(token: int, group: list[Outcome]) -> store.Ack:
    """What acknowledging one claim's successes writes: its token, and ``{pk: result}``."""
    return store.Ack(token, {outcome.item.pk: outcome.result for outcome in group})


class Settler:
    def __init__(self, using: str) -> None:
        self.using = using
        self.outcomes: queue.SimpleQueue[list[Outcome]] = queue.SimpleQueue()
        self.unsettled: list[Outcome] = []
        # One claim's successes, left for the next claim to acknowledge (``settle(hold=True)``).
        self.held: tuple[int, list[Outcome]] | None = None
        # Settled, not yet returned: a later step of the same ``settle()`` raised.
        self.settled: list[Outcome] = []
        self.processed = 0
        self.failed = 0

    def put(self, outcomes: list[Outcome]) -> None:
        """Hand over outcomes (from any thread)."""
        self.outcomes.put(outcomes)

    def wait(self, timeout: float) -> None:
        """Block until an outcome arrives, at most ``timeout`` seconds."""
        with contextlib.suppress(queue.Empty):
            self.unsettled += self.outcomes.get(timeout=timeout)

    def settle(self, *, hold: bool = False) -> list[Outcome]:
        """Write every outcome received so far; returns those now settled (and those
        settled before an earlier call raised).

        With ``hold``, one claim's successes are left unwritten as ``held``, for their
        acknowledgement to ride with the next claim (``acknowledged`` settles them).
        """
        while True:
            try:
                self.unsettled += self.outcomes.get_nowait()
            except queue.Empty:
                break
        by_claim: dict[int, list[Outcome]] = {}
        already: list[Outcome] = []  # acknowledged (or refused) by an atomic handler
        errors: list[Outcome] = []
        for outcome in self.unsettled:
            if outcome.error is not None:
                errors.append(outcome)
            elif outcome.acknowledged is None:
                by_claim.setdefault(outcome.item.claim_token or 0, []).append(outcome)
            else:
                already.append(outcome)
        self.held = by_claim.popitem() if hold and by_claim else None
        settled: list[Outcome] = []
        try:
            for token, group in by_claim.items():
                self._report_refused(
                    store.ack_many(QueueItem, self.using, acknowledgement(token, group)), group
                )
                settled += group
            settled += already
            for outcome in errors:
                if outcome.lost:
                    self._release(outcome)
                else:
                    self._fail(outcome)
                settled.append(outcome)
        finally:
            self._settled(settled)
        return self._take_settled()

    @property
    def holding(self) -> int:
        """How many successes are held for the next claim to acknowledge."""
        return len(self.held[1]) if self.held else 0

    def held_ack(self) -> store.Ack | None:
        """The held successes' acknowledgement, for the next claim to carry; None if none."""
        if self.held is None:
            return None
        return acknowledgement(*self.held)

    def acknowledged(self, count: int) -> list[Outcome]:
        """The held successes were acknowledged (``count`` of them accepted): settle them."""
        if self.held is None:
            return []
        group = self.held[1]
        self.held = None
        self._report_refused(count, group)
        self._settled(group)
        return self._take_settled()

    def _settled(self, settled: list[Outcome]) -> None:
        """What the database has leaves ``unsettled`` (even when a later write fails)."""
        if len(settled) == len(self.unsettled):
            self.unsettled = []
        else:
            done = {id(outcome) for outcome in settled}
            self.unsettled = [o for o in self.unsettled if id(o) not in done]
        self.settled += settled
        self._count(settled)
        if metrics.recorder is not None:  # --metrics-port: once per batch
            metrics.recorder.settled(settled)

    def _take_settled(self) -> list[Outcome]:
        taken, self.settled = self.settled, []
        return taken

    @staticmethod
    def _report_refused(acknowledged: int, group: list[Outcome]) -> None:
        if acknowledged < len(group):
            logger.warning(
                "%d of %d acknowledgements refused: their claims were taken over",
                len(group) - acknowledged,
                len(group),
            )

    @staticmethod
    def _release(outcome: Outcome) -> None:
        """The database failed, not the handler: READY again, no attempt counted, no
        delay. Unless the item's transaction committed after all (its COMMIT landed as the
        connection dropped): then the row is no longer held, and nothing changes."""
        item = outcome.item
        extra = about(item)
        released = store.release(item)
        outcome.exception = None  # the database's error: its last line says enough
        logger.warning(
            "%s #%s: the database failed, not the handler; %s: %s",
            item.queue,
            item.pk,
            "back to READY, no attempt counted" if released else "settled meanwhile",
            ((outcome.error or "").strip().splitlines() or [""])[-1],
            extra=extra,
        )

    def _fail(self, outcome: Outcome) -> None:
        item = outcome.item
        extra = about(item)
        final = not outcome.retry or item.attempts >= item.max_attempts
        if outcome.retry:
            store.retry(item, outcome.error, error_class=outcome.error_class)
        else:
            store.fail(item, outcome.error, error_class=outcome.error_class)
        # The one line about the handler's exception, with its traceback: ERROR when the
        # item has failed for good (what Sentry's logging integration reports by default).
        exception, outcome.exception = outcome.exception, None  # its frames: let them go
        logger.log(
            logging.ERROR if final else logging.WARNING,
            "%s #%s failed (attempt %d of %d)%s: %s",
            item.queue,
            item.pk,
            extra["attempt"],
            item.max_attempts,
            "" if final else ", will retry",
            ((outcome.error or "").strip().splitlines() or [""])[-1],
            exc_info=exception,
            extra=extra,
        )

    @staticmethod
    def _log_done(outcome: Outcome) -> None:
        item = outcome.item
        logger.debug(
            "%s #%s done in %.3f s", item.queue, item.pk, outcome.duration, extra=about(item)
        )

    def _count(self, outcomes: list[Outcome]) -> None:
        """Counters and signals for settled outcomes; the signals only where some receiver
        listens (checked once per batch, not sent item by item for nobody)."""
        done_heard = signals.heard(signals.item_done, QueueItem)
        failed_heard = signals.heard(signals.item_failed, QueueItem)
        debug = logger.isEnabledFor(logging.DEBUG)
        for outcome in outcomes:
            if outcome.acknowledged is False or outcome.lost:
                continue  # nothing happened: rolled back, or released to run again
            if outcome.error is None:
                self.processed += 1
                if debug:
                    self._log_done(outcome)
                if done_heard:
                    signals.item_done.send(
                        sender=QueueItem,
                        item=outcome.item,
                        result=outcome.result,
                        duration=outcome.duration,
                    )
            else:
                self.failed += 1
                if failed_heard:
                    signals.item_failed.send(
                        sender=QueueItem,
                        item=outcome.item,
                        error=outcome.error,
                        will_retry=outcome.item.status == Status.READY,
                        duration=outcome.duration,
                    )
