"""Fair and bounded queues against plain ones, in one run.

Claims: one consumer's claim rate (batch 10) on a plain backlog and on a fair one of the
same size (100 items per key: 10,000 rows over 100 keys, ``scale_rows`` over
``scale_rows / 100`` keys), each fair one as a percentage of the plain one of its size,
and each big one as a percentage of its 10,000-row counterpart (flat as it grows). The
backlogs are made by the database itself with the rounds a fair enqueue would give.

Enqueue: ``enqueue()`` one per transaction on a plain queue, on a bounded one (its
``MAX_SIZE`` never reached) and on a fair one (one key per 100 items).
"""

from __future__ import annotations

from typing import Any

from django.db import connections, transaction
from django.test.utils import override_settings

from django_txqueue import Queue, Status, conf

from ..progress import Progress
from ..target import Target
from .enqueue import timed
from .raw import RawQueue
from .report import percent
from .scale import BASE_READY, claim_rate, clear

ITEMS_PER_KEY = 100
UNREACHED = 10**12  # a MAX_SIZE the bench never fills


def queue_settings(target: Target, **options: Any) -> override_settings:
    """The project's TXQUEUE with ``options`` added for the bench's queue."""
    settings = conf.user_settings()
    queues = {**settings.get("QUEUES", {}), target.queue: options}
    return override_settings(TXQUEUE={**settings, "QUEUES": queues})


def run(
    target: Target, *, scale_rows: int, claims: int, enqueue_items: int, progress: Progress
) -> dict[str, Any]:
    enqueue = enqueue_rates(target, enqueue_items, progress)  # first: on a small table
    return {
        "claims": claim_rates(target, scale_rows, min(claims, BASE_READY), progress),
        "enqueue": enqueue,
    }


def claim_rates(
    target: Target, scale_rows: int, claims: int, progress: Progress
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for ready in (BASE_READY, scale_rows):
        for fair in (False, True):
            keys = max(1, ready // ITEMS_PER_KEY) if fair else 0
            label = f"{'fair' if fair else 'plain'}, {ready:,} ready"
            label += f" over {keys:,} keys" if fair else ""
            clear(target, progress)
            progress.phase(f"fair: filling {label}")
            raw = RawQueue(target)
            try:
                raw.insert_generated(ready, Status.READY, keys=keys)
            finally:
                raw.close()
            target.analyze()
            progress.phase(f"fair: claiming {claims:,} with {label}")
            with queue_settings(target, FAIR=fair):
                rate, claimed = claim_rate(target, claims)
            rows.append(
                {
                    "backlog": label,
                    "fair": fair,
                    "ready": ready,
                    "keys": keys,
                    "claimed": claimed,
                    "rate": rate,
                }
            )
    clear(target, progress)
    connections[target.alias].close()
    base = {row["fair"]: row["rate"] for row in rows if row["ready"] == BASE_READY}
    plain = {row["ready"]: row["rate"] for row in rows if not row["fair"]}
    for row in rows:
        row["percent_of_plain"] = percent(row["rate"], plain[row["ready"]])
        row["percent_of_10k"] = percent(row["rate"], base[row["fair"]])
    return rows


def enqueue_rates(target: Target, items: int, progress: Progress) -> list[dict[str, Any]]:
    """``enqueue()`` one per transaction: plain, bounded and fair, interleaved in three
    rounds so that a drift of the machine's load hits each alike."""
    kinds: dict[str, dict[str, Any]] = {
        "plain": {},
        "bounded (MAX_SIZE)": {"MAX_SIZE": UNREACHED},
        "fair (100 per key)": {"FAIR": True},
    }
    rates: dict[str, list[float]] = {kind: [] for kind in kinds}
    per_round = max(1, items // 3)
    # Dead rows of earlier parts would slow the bounded count down, for the bench's own
    # reasons: gone first (PostgreSQL's VACUUM, InnoDB's purge).
    clear(target, progress)
    target.analyze()
    for number in range(3):
        for kind, options in kinds.items():
            target.clear()
            with queue_settings(target, **options):
                queue = Queue(target.queue, using=target.alias)

                def enqueue_one(n: int, queue: Queue = queue) -> None:
                    with transaction.atomic(using=target.alias):
                        queue.enqueue({"n": n}, key=f"k{n // ITEMS_PER_KEY}")

                progress.phase(f"fair: enqueue(), {kind}, round {number + 1} of 3")
                rates[kind].append(timed(per_round, enqueue_one, progress, kind))
    target.clear()
    plain = sorted(rates["plain"])[1]
    return [
        {"what": kind, "rate": sorted(values)[1], "percent": percent(sorted(values)[1], plain)}
        for kind, values in rates.items()
    ]
