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

from django.db.models import Exists

from .. import conf, store
from ..db import dialect_for
from ..db.compiler import ClaimStatement
from ..models import QueueBound, QueuePause
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
        self._statements: dict[int, ClaimStatement] = {}  # compiled once per batch size
        # MAX_IN_FLIGHT, read once: a claim of a capped queue counts what runs first.
        self.cap: int | None = conf.queue_option(name, "MAX_IN_FLIGHT")

    @property
    def claimable(self) -> QueueItemQuerySet:
        """The items a claim may take once they are due: all of them, or in an ordered
        queue (or one with MAX_IN_FLIGHT_PER_KEY) those at the head of their key; none
        while the queue is paused."""
        limit = fairness.in_flight_limit(self.name)
        items = self.items if limit is None else fairness.in_key_order(self.items, limit)
        # The claim reads the pause flag in its own statement: a paused queue is never
        # claimed, by consumers or by anyone's claim(), with no query of its own. An
        # uncorrelated NOT EXISTS: PostgreSQL evaluates it once per statement (a one-time
        # filter), MySQL and SQLite as a constant; one primary-key probe either way.
        return items.filter(~Exists(QueuePause.objects.filter(queue=self.name)))  # type: ignore[return-value]

    def statement(self, limit: int) -> ClaimStatement:
        statement = self._statements.get(limit)
        if statement is None:
            statement = self._statements[limit] = ClaimStatement(
                self.claimable,
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
        sort after it (``resume_key``). A queue with ``MAX_IN_FLIGHT`` takes no more than
        its places left (``store.claim_capped``)."""
        options: dict[str, Any] = {
            "pid": pid,
            "strategy": strategy,
            "lease": lease,
            "after": after,
        }
        if self.cap is None:
            return store.claim(self.statement(limit), **options)
        return store.claim_capped(
            self.statement, self.name, self.cap, limit, QueueBound, **options
        )

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
        Returns how many were acknowledged and the claimed items. The consumer's loop.
        A queue with ``MAX_IN_FLIGHT`` acknowledges first: its claim counts what runs."""
        if self.cap is not None:
            acked = 0 if ack is None else store.ack_many(self.items.model, self.items.db, ack)
            return acked, self.claim(limit, pid=pid, strategy=strategy, lease=lease, after=after)
        return store.ack_and_claim(
            self.statement(limit),
            ack,
            pid=pid,
            strategy=strategy,
            lease=lease,
            after=after,
        )

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
    ) -> None:
        self.queues = queues
        self.options: dict[str, Any] = {"pid": pid, "strategy": strategy, "lease": lease}
        self.resumes: dict[str, Resume] = {}
        self.limit = 0
        self.ride: Ack | None = None
        self.acknowledged: int | None = None

    def claim(self, name: str) -> list[QueueItem]:
        """Up to ``limit`` of queue ``name``'s due items, carrying ``ride`` if no claim of
        this turn has yet."""
        resume = self.resumes.get(name)
        if resume is None:
            resume = self.resumes[name] = Resume(self.queues[name].claims)
        ack, self.ride = self.ride, None
        acknowledged, items = resume.ack_and_claim(ack, self.limit, **self.options)
        if ack is not None:
            self.acknowledged = acknowledged
        return items
