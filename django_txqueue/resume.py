"""Where a consumer's next claim of a queue starts reading (PostgreSQL, MySQL, MariaDB).

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
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .api import Queue
    from .models import QueueItem

FULL_CLAIM_EVERY = 1.0  # seconds
# When full claims are slow (an old snapshot holds many dead entries), at most this share
# of the claiming time goes to them: the next comes after 1 / FULL_CLAIM_SHARE times the
# last one's duration, if that is longer than FULL_CLAIM_EVERY.
FULL_CLAIM_SHARE = 0.05


class Resume:
    """One consumer's claims of one queue, each started where the last one ended."""

    def __init__(self, queue: Queue) -> None:
        self.queue = queue
        # An item's claim-order values, or None where claims cannot resume (another
        # vendor, a descending order, an ordered queue).
        self.key = queue.resume_key
        self.point: tuple[Any, ...] | None = None
        self.full_claim_due = 0.0

    def ack_and_claim(
        self,
        claim_token: int,
        results: dict[Any, Any],
        limit: int,
        *,
        pid: str,
        strategy: str = "auto",
        lease: float | timedelta | None = None,
    ) -> tuple[int, list[QueueItem]]:
        """``Queue.ack_and_claim`` after the resume point, or from the head."""
        after, started = self.after(), time.monotonic()
        options: dict[str, Any] = {"pid": pid, "strategy": strategy, "lease": lease}
        acknowledged, items = self.queue.ack_and_claim(
            claim_token, results, limit, after=after, **options
        )
        if after is not None and not items:  # nothing after the point: from the head
            after, started = None, time.monotonic()
            items = self.queue.claim(limit, **options)
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
