"""Fair queues and ordered groups: the round a new item joins, the items a claim may take.

**Fair** (``FAIR``): each item gets a round when it is enqueued, and claims serve the
rounds in order (within one, the usual priority, run_at, id order). A key's item goes
into the round after the last one served if the key has nothing waiting, else into the
round after its newest waiting item's. Round N thus holds the N-th waiting item of every
key: a snapshot of every key's head, taken ahead of time, delivered oldest head first;
an item pushed while a snapshot is served goes into the next one. A key with 10,000
waiting items holds rounds N to N+9,999, and a key that pushes one item meanwhile gets
round N+1: it waits one round at most.

The round comes from a plain read (``db/rounds.py``), with no lock and no counter row, so
producers never wait for each other. Two that read at once may put two items of one key
into the same round; the id orders them.

**Ordered** (``ORDERED``): a claim takes an item only while no earlier item of its key
is waiting and none is running: one item per key in flight, in enqueue order. A retried
item is waiting (READY, due later), so it holds its key back, as does a flow's WAITING
item; a FAILED one releases it.
``MAX_IN_FLIGHT_PER_KEY`` N is the same with N places per key: a key's first N
unfinished items may run at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.db.models import Count, Exists, OuterRef, Q

from .. import conf
from ..db.rounds import read_rounds
from ..status import Status

if TYPE_CHECKING:
    from django.db.models import Model, QuerySet

    from ..models import QueueItem

# Queue.stats() names this many of the keys with the most waiting items.
TOP_KEYS = 10


def in_flight_limit(queue: str) -> int | None:
    """How many items of one key ``queue`` runs at once (None: no limit). ORDERED is 1."""
    if conf.queue_option(queue, "ORDERED"):
        return 1
    limit = conf.queue_option(queue, "MAX_IN_FLIGHT_PER_KEY")
    return None if limit is None else int(limit)


# The queue settings that make every item need a key.
KEYED_BY = ("FAIR", "ORDERED", "MAX_IN_FLIGHT_PER_KEY")


def needs_key(queue: str) -> str | None:
    """The setting that makes every item of ``queue`` need a key, or None."""
    options = conf.queue_options(queue)
    return next((setting for setting in KEYED_BY if options[setting]), None)


def first_round(model: type[Model], queue: str, key: str | None, using: str) -> int:
    """The round of a new item of fair ``queue`` and ``key`` (the next ones of the same
    enqueue take the rounds after it)."""
    served, newest = read_rounds(model, queue, key, using)
    return max(served, newest) + 1


def in_key_order(items: QuerySet[QueueItem], limit: int) -> QuerySet[QueueItem]:
    """The items among ``items`` that a claim may take when each key runs at most
    ``limit`` at once, in enqueue order: those whose key's running items and waiting
    items before them number fewer than ``limit`` (and those with no key at all, from
    before the queue was limited). With ``limit`` 1, an ordered queue: no earlier item
    waiting and none running. One claim's snapshot counts the same items for each
    candidate, so a batch takes no more than the key's free places either.

    Per candidate, index probes of the key index that each stop at their count; the
    running items are few, and the planners read them once (PostgreSQL hashes them,
    MariaDB materialises them)."""
    same_key = items.model._default_manager.filter(key=OuterRef("key"), queue=OuterRef("queue"))
    running = same_key.filter(status=Status.IN_PROGRESS)
    # WAITING ones too: a flow's item keeps its place in its key's order (docs/flows.md).
    ahead = same_key.filter(
        Q(status=Status.READY) | Q(status=Status.WAITING), pk__lt=OuterRef("pk")
    )

    def at_least(rows: QuerySet[QueueItem], n: int) -> Exists:
        return Exists(rows[n - 1 : n])  # the row at offset n - 1 exists

    # Full for this item: its key's running items and the waiting ones ahead of it number
    # ``limit`` or more, whatever their primary keys (a running item may have been
    # enqueued after a waiting one that a rescue or a retry made READY again). As k
    # running and ``limit`` - k ahead, each an index probe that stops at its count.
    full = Q(at_least(running, limit)) | Q(at_least(ahead, limit))
    for k in range(1, limit):
        full |= Q(at_least(running, k)) & Q(at_least(ahead, limit - k))
    return items.filter(Q(key__isnull=True) | ~full)


def key_stats(waiting: QuerySet[QueueItem]) -> dict[str, Any]:
    """A queue's waiting items by key: how many keys have some, and the ``TOP_KEYS`` with
    the most, as ``[[key, count], ...]``."""
    per_key = waiting.order_by().values("key").annotate(n=Count("pk"))
    counts = sorted(((row["n"], row["key"]) for row in per_key), key=lambda r: (-r[0], r[1] or ""))
    return {
        "keys_waiting": len(counts),
        "top_keys": [[key, n] for n, key in counts[:TOP_KEYS]],
    }
