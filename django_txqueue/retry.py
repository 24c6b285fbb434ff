"""Retry back-off: exponential, capped, with jitter. Pure functions, no database."""

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
