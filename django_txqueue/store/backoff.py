"""Back-off: exponential, capped, with jitter. Pure functions, no database."""

from __future__ import annotations

import random
from datetime import timedelta


def backoff(attempts: int, base: float, cap: float) -> timedelta:
    """The wait before the next attempt, after ``attempts`` claims so far.

    ``base * 2 ** (attempts - 1)`` seconds capped at ``cap``, then "equal jitter": a
    uniform draw from the upper half, so retries of items that failed together spread
    out without ever collapsing to zero.
    """
    ceiling = min(cap, base * 2 ** max(attempts - 1, 0))
    return timedelta(seconds=ceiling / 2 + random.uniform(0, ceiling / 2))


# A consumer that cannot reach its database pauses 0.5 s, then twice as long each time,
# up to 30 s at start-up. In its loop, up to 1 s only: a failover's new primary (or a
# restarted server) is then claimed from within about a second of accepting writes, where
# a doubled pause would leave it idle for up to 30 s. A reconnection try is cheap.
FIRST_PAUSE = 0.5
MAX_PAUSE = 30.0
RECONNECT_MAX_PAUSE = 1.0


def next_pause(previous: float, cap: float = MAX_PAUSE) -> float:
    """The pause after one more failed try at the database (``previous``: 0 at first)."""
    return min(max(previous * 2, FIRST_PAUSE), cap)


def jittered(pause: float) -> float:
    """``pause`` give or take 20%, so that consumers that failed together spread out."""
    return pause * random.uniform(0.8, 1.2)
