"""Settling what handlers came to: one fenced acknowledgement per claim for the
successes, a retry or a failure for each error, then the signals and counters; and, in the
same call, the next claim, which carries a claim's successes where the database allows.

The consumer's main thread calls ``settle_and_claim()`` once per turn with the outcomes its
handler threads handed over, so every write happens on one thread and connection, and a
turn goes one way: the worker, the settler, the rotation's choice of queue, the claim.
An outcome leaves ``unsettled`` only once the database has it: after a lost connection the
rest is settled on a later turn, and what was settled before the error is returned by that
later call (the consumer's in-flight list forgets an item only when told it is settled).

An outcome the database failed (``Outcome.lost``: a lost connection, a refused
transaction) is released: READY again at once, no attempt counted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import cached_property
from typing import TYPE_CHECKING

from .. import signals, store
from ..models import QueueItem
from ..observe import metrics
from ..observe.logs import about
from ..status import Status
from .execution import Outcome

if TYPE_CHECKING:
    from django.dispatch import Signal

    from .claims import Claimer
    from .rotation import Rotation

# The logger name docs/tracing.md documents (and LOGGING settings name), kept from before
# this module moved into consumer/.
logger = logging.getLogger("django_txqueue.settle")


def acknowledgement(token: int, group: list[Outcome]) -> store.Ack:
    """What acknowledging one claim's successes writes: its token, ``{pk: result}``, and
    the items' ``dependent_count`` as the claim read them, where one is waited for: its
    acknowledgement then counts down what waits for it."""
    results = {outcome.item.pk: outcome.result for outcome in group}
    if not any(outcome.item.dependent_count for outcome in group):  # plain items
        return store.Ack(token, results)
    dependents = {outcome.item.pk: outcome.item.dependent_count for outcome in group}
    return store.Ack(token, results, dependents)


class Settler:
    """Settles one database's outcomes; with a ``rotation`` and its ``claimer``, claims
    there too, up to ``batch`` items a turn, one claim's successes riding with the claim
    where ``rides`` (the database acknowledges while claiming; a function that asks it is
    asked on the first settle, not as the consumer starts: the database may be down then,
    and Django's MySQL backend connects to learn what the server supports)."""

    def __init__(
        self,
        using: str,
        *,
        rotation: Rotation | None = None,
        claimer: Claimer | None = None,
        batch: int = 1,
        rides: bool | Callable[[], bool] = False,
    ) -> None:
        self.using = using
        self.rotation = rotation
        self.claimer = claimer
        self.batch = batch
        self._rides = rides
        self.unsettled: list[Outcome] = []
        # Settled, not yet returned: a later step of the same call raised.
        self.settled: list[Outcome] = []
        self.processed = 0
        self.failed = 0
        # Settled, not yet in the metrics (``metrics.recorder``): counted once per call.
        self._uncounted: list[Outcome] = []
        # The signals some receiver listens to (``signals.heard``), asked once per call.
        self.heard: frozenset[Signal] = frozenset()
        # At most this many items per claim, whatever the room (a recycling consumer's
        # claims left, ``recycling``); None: no cap.
        self.claim_cap: int | None = None

    @cached_property
    def rides(self) -> bool:
        return self._rides() if callable(self._rides) else self._rides

    def settle(self, arrived: list[Outcome]) -> list[Outcome]:
        """Write what ``arrived`` (and what an earlier call could not write) came to;
        returns the outcomes now settled. Claims nothing (a consumer that stops)."""
        return self.settle_and_claim(arrived, room=None)[0]

    def settle_and_claim(
        self, arrived: list[Outcome], *, room: int | None, free: int | None = None
    ) -> tuple[list[Outcome], list[QueueItem]]:
        """Write what ``arrived`` came to, and claim up to ``room`` more items than the
        acknowledged successes free (at most ``batch``, and of a rate-limited queue at
        most ``free``, the room without the claim-ahead) from the rotation's queues: one
        claim's successes ride with that claim (``room`` None: no claim). Returns the
        outcomes now settled (and those settled before an earlier call raised) and the
        claimed items."""
        self.unsettled += arrived
        by_claim: dict[int, list[Outcome]] = {}
        already: list[Outcome] = []  # acknowledged (or refused) by an atomic handler
        errors: list[Outcome] = []
        for outcome in self.unsettled:
            if outcome.error is not None or outcome.snooze is not None:
                errors.append(outcome)
            elif outcome.acknowledged is None:
                by_claim.setdefault(outcome.item.claim_token or 0, []).append(outcome)
            else:
                already.append(outcome)
        claiming = room is not None and self.rotation is not None
        riding = by_claim.popitem() if claiming and self.rides and by_claim else None
        # Who listens, asked once per call (nothing is sent item by item for nobody).
        self.heard = signals.heard(QueueItem)
        settled: list[Outcome] = []
        claimed: list[QueueItem] = []
        try:
            for token, group in by_claim.items():
                ack = acknowledgement(token, group)
                self._report_refused(store.ack_many(QueueItem, self.using, ack), group)
                settled += group
            settled += already
            for outcome in errors:
                if outcome.lost:
                    self._release(outcome)
                elif outcome.snooze is not None:
                    self._snooze(outcome)
                else:
                    self._fail(outcome)
                settled.append(outcome)
        finally:
            # What the database has, even when a later write failed; its signals before
            # the claim, which may retake an item (a receiver reads the row as settled).
            self._settled(settled)
        if claiming and room is not None:
            claimed = self._claim(room, riding, settled, free)
            if riding is not None:
                self._settled(riding[1])
            if signals.item_claimed in self.heard:
                for item in claimed:
                    signals.item_claimed.send(sender=QueueItem, item=item)
        if metrics.recorder is not None:  # --metrics-port: once per call
            metrics.recorder.turn(self._uncounted, claimed)
        self._uncounted = []
        taken, self.settled = self.settled, []
        return taken, claimed

    def _claim(
        self,
        room: int,
        riding: tuple[int, list[Outcome]] | None,
        settled: list[Outcome],
        free: int | None,
    ) -> list[QueueItem]:
        """Claim from the rotation's queues, ``room`` items besides those this call settled,
        ``riding`` (a claim's successes) carried by the first claim made, or acknowledged on
        their own if none is. The queues of the items settled are claimed from again: an
        ordered queue's next item, or a released one, may be claimable now."""
        assert self.rotation is not None and self.claimer is not None  # noqa: S101
        claimer, ack = self.claimer, None if riding is None else acknowledgement(*riding)
        counts_down = ack is not None and ack.dependents is not None  # waited for, riding
        # The items settled, and those riding, are finished: their room is free.
        limit = min(self.batch, room + len(settled) + (len(riding[1]) if riding else 0))
        if self.claim_cap is not None:
            limit = min(limit, self.claim_cap)
        woken = {outcome.item.queue for outcome in settled} if self.rotation.idle else ()
        claimed: list[QueueItem] = []
        if limit > 0:
            claimer.limit, claimer.ride, claimer.acknowledged = limit, ack, None
            claimer.free = free
            claimed = self.rotation.first_to_give(claimer.claim, woken=woken)
            ack = claimer.ride  # still here: no claim was made to carry it
        elif woken:
            self.rotation.wake(woken)
        if counts_down or any(outcome.item.dependent_count for outcome in settled):
            # Their acknowledgements may have released items of any queue, one this call
            # claimed from before they did (PostgreSQL's claim cannot see the release in
            # its own statement): every queue is claimed again, by a burst run too.
            self.rotation.wake(None)
            self.rotation.passed_over = True
        if riding is not None:
            accepted = claimer.acknowledged
            if ack is not None:
                accepted = store.ack_many(QueueItem, self.using, ack)
            self._report_refused(accepted or 0, riding[1])
        return claimed

    def _settled(self, settled: list[Outcome]) -> None:
        """What the database has leaves ``unsettled``; its counters and signals now, its
        metrics with the call's claim."""
        if len(settled) == len(self.unsettled):
            self.unsettled = []
        else:
            done = {id(outcome) for outcome in settled}
            self.unsettled = [o for o in self.unsettled if id(o) not in done]
        self.settled += settled
        self._uncounted += settled
        self._count(settled)

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
            store.retry(item, outcome.error, outcome.delay, error_class=outcome.error_class)
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
    def _snooze(outcome: Outcome) -> None:
        item, seconds = outcome.item, outcome.snooze or 0.0
        if store.snooze(item, seconds):
            logger.info("%s #%s snoozed for %g s", item.queue, item.pk, seconds, extra=about(item))

    @staticmethod
    def _log_done(outcome: Outcome) -> None:
        item = outcome.item
        logger.debug(
            "%s #%s done in %.3f s", item.queue, item.pk, outcome.duration, extra=about(item)
        )

    def _count(self, outcomes: list[Outcome]) -> None:
        """Counters and signals (where ``heard``) for settled outcomes."""
        heard, debug = self.heard, logger.isEnabledFor(logging.DEBUG)
        for outcome in outcomes:
            if outcome.acknowledged is False or outcome.lost or outcome.snooze is not None:
                continue  # nothing happened: rolled back, released or snoozed to run again
            if outcome.error is None:
                self.processed += 1
                if debug:
                    self._log_done(outcome)
                if signals.item_done in heard:
                    signals.item_done.send(
                        sender=QueueItem,
                        item=outcome.item,
                        result=outcome.result,
                        duration=outcome.duration,
                    )
            else:
                self.failed += 1
                if signals.item_failed in heard:
                    signals.item_failed.send(
                        sender=QueueItem,
                        item=outcome.item,
                        error=outcome.error,
                        will_retry=outcome.item.status == Status.READY,
                        duration=outcome.duration,
                    )
