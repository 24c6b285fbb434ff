"""One queue's claim path: its claim statements, compiled once per batch size and run
through ``store``, and where a consumer's next claim starts reading (``Resume``).

Resuming matters on PostgreSQL, MySQL and MariaDB (the dialect's ``resumes_claims``).

While any transaction keeps an old snapshot open (a long report, a session idle in a
transaction, a replica's ``hot_standby_feedback``), PostgreSQL may remove neither the rows
claimed since nor their entries in the READY index, and a claim that reads that index from
its head steps over all of them: the claim rate fell to 2% in ten minutes. InnoDB keeps
them until its purge runs, and its locking reads step over them slowly under READ
COMMITTED. So a consumer
starts each claim right after the last item it claimed ("resumes"), and reads from the head
(a full claim) when a resumed claim finds nothing, after a claim that took fewer items than
it asked for, and at least every ``FULL_CLAIM_EVERY`` seconds. An item that sorts before
the last one claimed (a more urgent one enqueued meanwhile, a rescued or released one)
thus waits that long at most before a busy consumer sees it; an idle consumer's claims are
full ones.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.db.models import Exists, OuterRef
from django.db.models.functions import Now

from .. import store
from ..db import dialect_for
from ..db.compiler import ClaimStatement
from ..models import QueueBound, QueuePause, QueueRate
from ..store import fairness

if TYPE_CHECKING:
    from ..api import Queue
    from ..db.acks import Ack
    from ..models import QueueItem, QueueItemQuerySet

FULL_CLAIM_EVERY = 1.0  # seconds
# When full claims are slow (an old snapshot holds many dead entries), at most this share
# of the claiming time goes to them: the next comes after 1 / FULL_CLAIM_SHARE times the
# last one's duration, if that is longer than FULL_CLAIM_EVERY.
FULL_CLAIM_SHARE = 0.05


class Claims:
    """The claims of one queue's ``items`` (its rows in one database)."""

    def __init__(self, name: str, items: QueueItemQuerySet) -> None:
        self.name = name
        self.items = items
        self._statements: dict[tuple[int, bool], ClaimStatement] = {}  # compiled once each
        # MAX_IN_FLIGHT and the rate limits, read once (docs/limits.md).
        self.limits = store.Limits.of(name)
        self.limited = bool(self.limits)
        self.rate_limited = self.limits.rate is not None or self.limits.per_key is not None
        # RATE_LIMIT: this process's grants of the queue's budget, which its claims spend.
        self.allowance = (
            None
            if self.limits.rate is None
            else store.Allowance(QueueRate, name, self.limits.rate, items.db)
        )
        # RATE_LIMIT_PER_KEY: this process's grants of every key's budget while it is ample.
        self.key_grants = (
            None
            if self.limits.per_key is None
            else store.KeyGrants(QueueRate, name, self.limits.per_key, items.db)
        )
        # After a claim that a spent rate budget held back: when it has room again
        # (time.monotonic()); 0.0 otherwise.
        self.held_until = 0.0

    @property
    def claimable(self) -> QueueItemQuerySet:
        """The items a claim may take once they are due (``claimable_by``)."""
        return self.claimable_by(granted=False)

    def claimable_by(self, *, granted: bool) -> QueueItemQuerySet:
        """The items a claim may take once they are due: all of them, or in an ordered
        queue (or one with MAX_IN_FLIGHT_PER_KEY) those at the head of their key; none
        while the queue is paused. With RATE_LIMIT_PER_KEY, past the keys whose budget is
        spent, unless the claim is ``granted`` by ``store.KeyGrants``: a grant was counted
        against every key's budget already."""
        limit = fairness.in_flight_limit(self.name)
        items = self.items if limit is None else fairness.in_key_order(self.items, limit)
        if self.limits.per_key is not None and not granted:
            spent = QueueRate.objects.filter(
                queue=self.name, per_key=True, key=OuterRef("key"), full_until__gt=Now()
            )
            items = items.filter(~Exists(spent))
        # The claim reads the pause flag in its own statement: a paused queue is never
        # claimed, by consumers or by anyone's claim(), with no query of its own. An
        # uncorrelated NOT EXISTS: PostgreSQL evaluates it once per statement (a one-time
        # filter), MySQL and SQLite as a constant; one primary-key probe either way.
        return items.filter(~Exists(QueuePause.objects.filter(queue=self.name)))  # type: ignore[return-value]

    def statement(self, limit: int, *, granted: bool = False) -> ClaimStatement:
        """The claim of ``limit`` items (``claimable_by``), compiled once."""
        statement = self._statements.get((limit, granted))
        if statement is None:
            statement = self._statements[limit, granted] = ClaimStatement(
                self.claimable_by(granted=granted),
                limit,
                queue=self.name,
                reads_other_rows=fairness.in_flight_limit(self.name) is not None,
            )
        return statement

    def claim(
        self,
        limit: int = 1,
        *,
        pid: str | None = None,
        strategy: str = "auto",
        lease: float | timedelta | None = None,
        after: tuple[Any, ...] | None = None,
    ) -> list[QueueItem]:
        """Claim up to ``limit`` due items (``store.claim``); ``after``: only those that
        sort after it (``resume_key``). A queue with ``MAX_IN_FLIGHT`` or a rate limit
        takes no more than its places or budget left (``store.claim_limited``)."""
        options: dict[str, Any] = {
            "pid": pid,
            "strategy": strategy,
            "lease": lease,
            "after": after,
        }
        if not self.limited:
            return store.claim(self.statement(limit), **options)
        return self._claim_limited(None, limit, options)[1]

    def ack_and_claim(
        self,
        ack: Ack | None,
        limit: int = 1,
        *,
        pid: str | None = None,
        strategy: str = "auto",
        lease: float | timedelta | None = None,
        after: tuple[Any, ...] | None = None,
    ) -> tuple[int, list[QueueItem]]:
        """Acknowledge ``ack``, items of one claim (of any queue; None: none), then claim as
        ``claim`` does; together where the database allows (``store.ack_and_claim``).
        Returns how many were acknowledged and the claimed items. The consumer's loop."""
        options: dict[str, Any] = {"pid": pid, "strategy": strategy, "lease": lease}
        if not self.limited:
            return store.ack_and_claim(self.statement(limit), ack, after=after, **options)
        return self._claim_limited(ack, limit, {**options, "after": after})

    def _claim_limited(
        self, ack: Ack | None, limit: int, options: dict[str, Any]
    ) -> tuple[int, list[QueueItem]]:
        """``ack_and_claim`` of a limited queue: no more than the grant of its RATE_LIMIT
        allows (``store.Allowance``), then, with a cap or a rate per key that no grant of
        every key's budget covers (``store.KeyGrants``), in a transaction that counts them
        (``store.claim_limited``), the acknowledgement made first; else the plain claim,
        the acknowledgement riding with it."""
        allowance, held_until = self.allowance, 0.0
        asked = limit if allowance is None else allowance.take(limit)
        if allowance is not None and not asked:
            held_until = allowance.held_until
        grants = self.key_grants if self.limits.cap is None else None
        under_grant = grants is not None and asked > 0 and grants.covers(asked)
        if self.limits.cap is None and (self.limits.per_key is None or under_grant):
            if asked:
                statement = self.statement(asked, granted=under_grant)
                acked, items = store.ack_and_claim(statement, ack, **options)
            else:
                acked, items = (0 if ack is None else self._ack(ack)), []
            if grants is not None and under_grant:
                grants.count(items)
        else:
            acked, items = (0 if ack is None else self._ack(ack)), []
            if asked:
                items, held_for = store.claim_limited(
                    self.statement,
                    self.name,
                    self.limits,
                    asked,
                    bounds=QueueBound,
                    rates=QueueRate,
                    **options,
                )
                if held_for is not None:
                    held_until = time.monotonic() + held_for
        if allowance is not None and asked:
            allowance.spent(asked, len(items))
        self.held_until = held_until
        return acked, items

    def _ack(self, ack: Ack) -> int:
        return store.ack_many(self.items.model, self.items.db, ack)

    @property
    def resume_key(self) -> Callable[[QueueItem], tuple[Any, ...]] | None:
        """An item's claim-order values, for a claim to start after it, or None where this
        queue's claims cannot: on a database that does not need it, and in an ordered
        queue, whose held-back items become claimable behind that point."""
        statement = self.statement(1)
        resumes = dialect_for(statement.alias).resumes_claims and statement.resumable
        return statement.resume_key if resumes and not statement.reads_other_rows else None


class Resume:
    """One consumer's claims of one queue, each started where the last one ended."""

    def __init__(self, claims: Claims) -> None:
        self.claims = claims
        # An item's claim-order values, or None where claims cannot resume (another
        # vendor, a descending order, an ordered queue).
        self.key = claims.resume_key
        self.point: tuple[Any, ...] | None = None
        self.full_claim_due = 0.0

    def ack_and_claim(
        self,
        ack: Ack | None,
        limit: int,
        *,
        pid: str,
        strategy: str = "auto",
        lease: float | timedelta | None = None,
    ) -> tuple[int, list[QueueItem]]:
        """``Claims.ack_and_claim`` after the resume point, or from the head."""
        after, started = self.after(), time.monotonic()
        options: dict[str, Any] = {"pid": pid, "strategy": strategy, "lease": lease}
        acknowledged, items = self.claims.ack_and_claim(ack, limit, after=after, **options)
        if after is not None and not items:  # nothing after the point: from the head
            after, started = None, time.monotonic()
            items = self.claims.claim(limit, **options)
        self.claimed(items, limit, full=after is None, seconds=time.monotonic() - started)
        return acknowledged, items

    def after(self) -> tuple[Any, ...] | None:
        """Where the next claim starts: after this point, or at the head (None)."""
        if self.point is None or time.monotonic() >= self.full_claim_due:
            return None
        return self.point

    def claimed(self, items: Sequence[Any], limit: int, *, full: bool, seconds: float) -> None:
        """A claim (``full``: from the head) took ``items`` of ``limit`` in ``seconds``."""
        if full:
            wait = max(FULL_CLAIM_EVERY, seconds / FULL_CLAIM_SHARE)
            self.full_claim_due = time.monotonic() + wait
        if self.key is None or len(items) < limit:
            self.point = None  # at the queue's tail: the next claim reads from the head
        else:
            self.point = self.key(items[-1])


class Claimer:
    """A consumer's claims of its queues on one database (``queues``, by name, which may
    grow): each queue's ``Resume``, made on first use. A turn sets ``limit`` and ``ride``,
    the acknowledgement the turn's first claim carries; ``claim(name)`` then claims, and
    ``acknowledged`` says how many of ``ride``'s items it accepted (``ride`` is None once
    carried)."""

    def __init__(
        self,
        queues: dict[str, Queue],
        *,
        pid: str,
        strategy: str = "auto",
        lease: float | timedelta | None = None,
        held: dict[str, float] | None = None,
    ) -> None:
        self.queues = queues
        # Rate-limited queues whose last claim a spent budget held back: when each has
        # room again (time.monotonic()), for the rotation to pass them over until then.
        self.held = {} if held is None else held
        self.options: dict[str, Any] = {"pid": pid, "strategy": strategy, "lease": lease}
        self.resumes: dict[str, Resume] = {}
        self.limit = 0
        # At most this many of a rate-limited queue's items (the batch's room without the
        # claim-ahead: none are claimed before they can start); None: ``limit``.
        self.free: int | None = None
        self.ride: Ack | None = None
        self.acknowledged: int | None = None

    def claim(self, name: str) -> list[QueueItem]:
        """Up to ``limit`` of queue ``name``'s due items, carrying ``ride`` if no claim of
        this turn has yet."""
        resume = self.resumes.get(name)
        if resume is None:
            resume = self.resumes[name] = Resume(self.queues[name].claims)
        limit = self.limit
        if self.free is not None and resume.claims.rate_limited:
            limit = min(limit, self.free)
            if limit <= 0:  # no room but the claim-ahead's: claimed once there is,
                self.held[name] = time.monotonic()  # not idle meanwhile
                return []
        ack, self.ride = self.ride, None
        acknowledged, items = resume.ack_and_claim(ack, limit, **self.options)
        if resume.claims.rate_limited:
            self.held[name] = resume.claims.held_until
        if ack is not None:
            self.acknowledged = acknowledged
        return items
