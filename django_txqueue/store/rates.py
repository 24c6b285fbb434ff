"""Rate limits' budgets (``RATE_LIMIT``, ``RATE_LIMIT_PER_KEY``): a ``QueueRate`` row per
limit holds the claims of the last period, each with its time by the database clock and
its number of items.

The budget is a sliding period, not a calendar one: at most N items are claimed in any
period-long stretch of the database clock, wherever it starts. The record needs no index
on the items and stays small: past ``KEPT_CLAIMS`` entries the oldest are merged into the
next one, which counts them until it leaves the period itself (longer, never shorter).

- A key's budget (``RATE_LIMIT_PER_KEY``) is counted by each claim, in its transaction:
  the claim locks the rows of the keys it took, keeps the items their budgets have room
  for, and records them timed by the database after the claim (``lock_budgets``,
  ``record``). Its items were claimed before that read, which may have waited for another
  claim's lock: the claims of ``MAX_LAG`` seconds before the period stay recorded, for a
  claim read that late to count, and one read later than that keeps nothing (its items
  go back READY, uncounted).
- A key's budget is also granted to a consumer a span at a time while it is ample
  (``KeyGrants``): a grant lets the claims of one span take up to N items of *every*
  key, in their plain statements, and counts N against every key's budget (the queue's
  row of key ``SHARED``, which a claim that counts its keys locks and reads first).
- A queue's own budget (``RATE_LIMIT``) is granted to a consumer a part at a time
  (``Allowance``): a grant of up to the budget left, recorded as claimed at the end of a
  short span (a tenth of the period, at most a second), which the consumer's claims spend
  before that span is over, in their plain statements. Recorded at the span's end, a
  grant counts as long as any claim made under it, or longer; what a consumer did not
  claim is given back. One transaction per span instead of one per claim: a queue whose
  budget is above its drain rate drains at nearly its unlimited rate.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import transaction
from django.db.models.functions import Now

from ..db import dialect_for
from .conflicts import retrying_conflicts

if TYPE_CHECKING:
    from django.db.models import Model

    from ..validation import Rate

KEPT_CLAIMS = 100
# A grant of a queue's budget is spent within this share of the period, at most
# MAX_SPAN seconds; its claims stop SPAN_MARGIN of the span before its end, so that a
# claim that took that long still happened before the time the grant is recorded at.
SPAN_SHARE = 0.1
MAX_SPAN = 1.0
SPAN_MARGIN = 0.2
# How long after its claim a key's budget may be read (``Budget.late``): the claims of
# this long before the period are kept for such a read to count.
MAX_LAG = 5.0  # seconds
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# The key of a queue's row of key grants, which count against every key (an item's key is
# never empty).
SHARED = ""


def micros(moment: datetime) -> int:
    """``moment`` in microseconds since the epoch (naive: UTC, as Django stores it)."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return (moment - _EPOCH) // timedelta(microseconds=1)


@dataclass
class Budget:
    """One limit's row, read under its lock at ``now`` (the database clock): what is
    left of ``rate`` in the period that ends now, and what a claim records. ``late``: read
    more than ``MAX_LAG`` after the claim it counts, which then takes nothing."""

    rate: Rate
    row: Any
    now: datetime
    late: bool = False
    claims: list[list[int]] = field(init=False)
    since: int = field(init=False)  # the period's start, in microseconds
    left: int = field(init=False)
    taken: int = 0

    def __post_init__(self) -> None:
        claims = list(self.row.claims)
        if self.row.last_at is not None and self.row.last_items:
            claims.append([micros(self.row.last_at), self.row.last_items])
        self.since = micros(self.now) - self.rate.period * 1_000_000
        # Kept while a claim read up to MAX_LAG late would count them: another claim's
        # read, later than this one, may come with an earlier ``now``.
        kept_since = self.since - round(MAX_LAG * 1_000_000)
        self.claims = [claim for claim in claims if claim[0] > kept_since]
        self.left = max(self.rate.limit - sum(n for _, n in self.counted), 0)

    @property
    def counted(self) -> list[list[int]]:
        """The claims inside the period: timed later than its start."""
        return [claim for claim in self.claims if claim[0] > self.since]

    def share(self, shared: Budget) -> None:
        """Leave out of what is left the key grants ``shared`` counts: each may have taken
        that many of this key's items."""
        self.left = max(self.left - sum(n for _, n in shared.counted), 0)

    def take(self) -> bool:
        """Count one more item of this claim against the budget, if any is left."""
        if self.late or self.taken >= self.left:
            return False
        self.taken += 1
        return True

    @property
    def full_until(self) -> datetime | None:
        """When, with this claim's items, a budget spent has room again (the oldest claim
        counted leaves the period); None while some is left."""
        if self.taken < self.left:
            return None
        counted = self.counted
        oldest = counted[0][0] if counted else micros(self.now)
        moment = _EPOCH + timedelta(microseconds=oldest, seconds=self.rate.period)
        return moment if self.now.tzinfo else moment.replace(tzinfo=None)  # as USE_TZ has it

    def room_in(self) -> float:
        """Seconds until a spent budget has room again (the oldest claim counted leaves
        the period)."""
        full_until = self.full_until
        return 0.0 if full_until is None else (full_until - self.now).total_seconds()

    def recorded(self) -> Any:
        """The row with this claim recorded: its items timed by the database as the row is
        written, after the claim (``last_at``), the older claims kept within bounds."""
        row = self.row
        row.claims, row.last_at, row.last_items = kept(self.claims), Now(), self.taken
        row.full_until = self.full_until
        return row


def kept(claims: list[list[int]]) -> list[list[int]]:
    """``claims`` within ``KEPT_CLAIMS``: the oldest merged into the next, counted longer."""
    if len(claims) <= KEPT_CLAIMS:
        return claims
    merged = claims[-KEPT_CLAIMS]
    merged[1] += sum(n for _, n in claims[:-KEPT_CLAIMS])
    return claims[-KEPT_CLAIMS:]


def lock_budgets(
    rates: type[Model],
    queue: str,
    keys: list[str],
    rate: Rate,
    *,
    per_key: bool,
    using: str,
    claimed: float | None = None,
) -> dict[str, Budget]:
    """Lock and read the rows of ``queue``'s limit ``rate`` for ``keys`` (``[""]`` for the
    queue's own limit), creating those missing, in key order: each key's ``Budget``, at
    the database's time of the read, or, for a claim made before it, sent at
    ``claimed`` (time.monotonic()), at the claim's time at the latest (``_locked``)."""
    rows = rates._default_manager.using(using).filter(queue=queue, per_key=per_key)
    budgets = _locked(rows, keys, rate, using, claimed)
    if missing := [key for key in keys if key not in budgets]:
        new = [rates(queue=queue, per_key=per_key, key=key) for key in missing]
        rows.bulk_create(new, ignore_conflicts=True)
        budgets.update(_locked(rows, missing, rate, using, claimed))
    return budgets


def _locked(
    rows: Any, keys: list[str], rate: Rate, using: str, claimed: float | None
) -> dict[str, Budget]:
    locked = dialect_for(using).locked(rows.filter(key__in=keys), touch="last_items")
    found = list(locked.order_by("key").annotate(database_now=Now()))
    # The claim's items are timed by the database as its statement ran, before this read:
    # a budget counted from the read's time would leave out claims of the period before
    # them. The read's time less what passed here since the claim was sent is no later.
    lag = timedelta(seconds=0 if claimed is None else time.monotonic() - claimed)
    late = lag.total_seconds() > MAX_LAG
    return {row.key: Budget(rate, row, row.database_now - lag, late) for row in found}


def record(rates: type[Model], budgets: list[Budget], using: str) -> None:
    """Write what the claims under ``budgets`` took, in one statement: the rows of those
    that took any, and of those found spent (their ``full_until`` up to date, so that
    the next claim passes their keys over)."""
    rows = [budget.recorded() for budget in budgets if budget.taken or not budget.left]
    manager = rates._default_manager.using(using)
    if len(rows) == 1:  # the usual case: a plain UPDATE, not bulk_update's CASE per column
        row = rows[0]
        manager.filter(pk=row.pk).update(**{name: getattr(row, name) for name in RECORDED})
    elif rows:
        manager.bulk_update(rows, RECORDED)


RECORDED = ["claims", "last_at", "last_items", "full_until"]


def write_claims(
    rates: type[Model], budget: Budget, using: str, full_until: datetime | None = None
) -> None:
    """Write ``budget``'s claims (within bounds) to its row, as grants change them."""
    rows = rates._default_manager.using(using).filter(pk=budget.row.pk)
    rows.update(claims=kept(budget.claims), full_until=full_until)


def seconds_to_room(
    rates: type[Model], queue: str, using: str, *, claimed: float | None = None
) -> float | None:
    """Seconds until the first of ``queue``'s keys whose budget is spent has room again
    (None: no key's is spent), or was spent when a claim sent at ``claimed``
    (time.monotonic()) ran: 0 for one that has room since, whose items that claim passed
    over."""
    lag = timedelta(seconds=0 if claimed is None else time.monotonic() - claimed)
    rows = rates._default_manager.using(using).filter(
        queue=queue, per_key=True, full_until__gt=Now() - lag
    )
    room = rows.annotate(database_now=Now()).order_by("full_until")
    first = room.values_list("full_until", "database_now").first()
    return None if first is None else max((first[0] - first[1]).total_seconds(), 0.0)


def used(rates: type[Model], queue: str, rate: Rate, using: str) -> int:
    """How many of ``queue``'s items were claimed under its own ``rate`` in the period that
    ends now (as the next claim would count them)."""
    rows = rates._default_manager.using(using).filter(queue=queue, per_key=False, key="")
    row = rows.annotate(database_now=Now()).first()
    return 0 if row is None else sum(n for _, n in Budget(rate, row, row.database_now).counted)


def keys_spent(rates: type[Model], queue: str, using: str) -> int:
    """How many of ``queue``'s keys have no budget left now."""
    rows = rates._default_manager.using(using).filter(queue=queue, per_key=True)
    return rows.filter(full_until__gt=Now()).count()


class Allowance:
    """This process's grants of ``queue``'s own budget (``rate``, rows of ``rates`` on
    ``using``): ``take(limit)`` before a claim, ``spent(asked, claimed)`` after it."""

    def __init__(self, rates: type[Model], queue: str, rate: Rate, using: str) -> None:
        self.rates, self.queue, self.rate, self.using = rates, queue, rate, using
        self.span = min(rate.period * SPAN_SHARE, MAX_SPAN)
        self.units = 0  # left of the grant held
        self.until = 0.0  # its claims' deadline (time.monotonic())
        self.at = 0  # the grant's record: its time (microseconds), which names it
        self.granted = 0  # the size of the last grant
        # After a grant refused (no budget left): when the budget has room (monotonic).
        self.held_until = 0.0

    def take(self, limit: int) -> int:
        """How many of ``limit`` items the next claim may take: from the grant held, or
        from a new one (0: none left; ``held_until`` says when there is room)."""
        now = time.monotonic()
        if self.units <= 0 or now >= self.until:
            self._renew(limit, now)
        taken = min(limit, self.units)
        self.units -= taken
        return taken

    def spent(self, asked: int, claimed: int) -> None:
        """A claim that asked for ``asked`` items took ``claimed``: fewer, and the queue
        has none due now, so what is left of the grant goes back to the budget."""
        self.units += asked - claimed
        if claimed < asked:
            self._give_back()

    def _renew(self, limit: int, now: float) -> None:
        """Give back what is left of the grant held, and take another: twice the last if
        that one was spent in time, else what its claims took; ``limit`` at least, at
        most the budget left."""
        used = self.granted - max(self.units, 0)
        want = 2 * self.granted if self.units <= 0 else used
        self._give_back()
        want = min(max(limit, want), self.rate.limit)
        self.units, self.at, room_in = retrying_conflicts(self._grant, self.using, want)
        self.granted = self.units
        self.until = now + self.span * (1 - SPAN_MARGIN)
        self.held_until = now + room_in if not self.units else 0.0

    def _grant(self, want: int) -> tuple[int, int, float]:
        with transaction.atomic(using=self.using):
            budget = lock_budgets(
                self.rates, self.queue, [""], self.rate, per_key=False, using=self.using
            )[""]
            units = min(want, budget.left)
            at = micros(budget.now) + round(self.span * 1_000_000)
            if units:
                budget.claims.append([at, units])
                budget.taken = units
                write_claims(self.rates, budget, self.using, budget.full_until)
            return units, at, budget.room_in()

    def _give_back(self) -> None:
        """Return what is left of the grant held to the budget (uncounted from its record),
        unless the record was merged into another meanwhile (then it counts, unused)."""
        if self.units > 0:
            retrying_conflicts(self._ungrant, self.using, self.units)
        self.units = 0

    def _ungrant(self, units: int) -> None:
        with transaction.atomic(using=self.using):
            budget = lock_budgets(
                self.rates, self.queue, [""], self.rate, per_key=False, using=self.using
            )[""]
            for claim in budget.claims:
                if claim[0] == self.at:
                    claim[1] = max(claim[1] - units, 0)
                    budget.claims = [c for c in budget.claims if c[1]]
                    write_claims(self.rates, budget, self.using)
                    return


class KeyGrants:
    """This process's grants of ``queue``'s per-key budget (``rate``, rows of ``rates`` on
    ``using``): ``covers(limit)`` before a claim, ``count(items)`` after one it covered.

    A grant of N lets the claims of one span take up to N items of each key, with no
    statement of their own. It is recorded in the ``SHARED`` row at the span's end, as a
    claim of N items of every key, so that each key's budget counts it as long as any claim
    made under it. It is given while the budget is ample only: at most half of what the
    most used key has left, and no less than a claim may take. Renewed, a grant is given
    back down to what its most used key took.
    """

    def __init__(self, rates: type[Model], queue: str, rate: Rate, using: str) -> None:
        self.rates, self.queue, self.rate, self.using = rates, queue, rate, using
        self.span = min(rate.period * SPAN_SHARE, MAX_SPAN)
        self.units = 0  # the grant held: items of each key
        self.until = 0.0  # its claims' deadline (time.monotonic())
        self.at = 0  # its record: its time (microseconds), which names it
        self.used: Counter[str] = Counter()  # items of each key claimed under it
        self.most = 0  # of which the most of one key
        self.refused_until = 0.0  # after a grant refused: when to ask again (monotonic)

    def covers(self, limit: int) -> bool:
        """Whether a claim of up to ``limit`` items may go under a grant (renewed when
        this one ends or a key of it could pass its units): no key's items then can."""
        now = time.monotonic()
        if self.units and now < self.until and self.most + limit <= self.units:
            return True
        if now < self.refused_until:
            return False
        want = 2 * max(limit, self.most)
        self.units, self.at = retrying_conflicts(self._renew, self.using, want, limit)
        self.used, self.most = Counter(), 0
        self.until = now + self.span * (1 - SPAN_MARGIN)
        self.refused_until = 0.0 if self.units else now + self.span
        return bool(self.units)

    def count(self, items: list[Any]) -> None:
        """The items a claim under the grant took."""
        for item in items:
            if item.key is not None:
                self.used[item.key] += 1
                self.most = max(self.most, self.used[item.key])

    def _renew(self, want: int, limit: int) -> tuple[int, int]:
        with transaction.atomic(using=self.using):
            shared = lock_budgets(
                self.rates, self.queue, [SHARED], self.rate, per_key=True, using=self.using
            )[SHARED]
            for claim in shared.claims:  # the grant held, given back down to what it took
                if claim[0] == self.at:
                    claim[1] = self.most
            shared.claims = [claim for claim in shared.claims if claim[1]]
            granted = sum(n for _, n in shared.counted)
            left = self.rate.limit - granted - self._most_taken_by_a_key(shared.now)
            units = min(want, left // 2)
            units = units if units >= limit else 0
            at = micros(shared.now) + round(self.span * 1_000_000)
            if units:
                shared.claims.append([at, units])
            write_claims(self.rates, shared, self.using)
            return units, at

    def _most_taken_by_a_key(self, now: datetime) -> int:
        """The most items of one key that claims counting their keys took in the period
        that ends ``now`` (the grants' row locked: none of them is under way)."""
        rows = self.rates._default_manager.using(self.using).filter(
            queue=self.queue, per_key=True, last_at__gt=now - timedelta(seconds=self.rate.period)
        )
        budgets = (Budget(self.rate, row, now) for row in rows.exclude(key=SHARED))
        return max((sum(n for _, n in budget.counted) for budget in budgets), default=0)
