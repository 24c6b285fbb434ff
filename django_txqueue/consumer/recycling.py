"""Recycling: a consumer process that has done enough (``run_queue_consumer --max-items N
--max-memory MB --max-age SECONDS``) stops claiming, finishes the items it holds and exits
0, for its supervisor (``--processes``) or service manager to start a fresh one: a handler
that leaks memory, in a C extension say, never grows a process until the kernel kills it.

Nothing is released or lost: ``--max-items`` caps the claims themselves, so a process
claims exactly N items (fewer if the queues run dry) and runs each; the other limits are
checked between turns, and the items claimed by then are run too.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
import time
from dataclasses import dataclass

# The environment variable naming the pipe a supervisor reads why its child exited 0:
# recycled (to be replaced), or done (a --burst run that drained its queues).
RECYCLE_FD = "TXQUEUE_RECYCLE_FD"
# Seconds between two looks at the process's memory (a read of /proc).
MEMORY_CHECK_INTERVAL = 1.0


@dataclass(frozen=True)
class Recycling:
    """The limits a consumer process recycles at; None: no such limit."""

    max_items: int | None = None
    max_memory_mb: float | None = None
    max_age: float | None = None


class Recycler:
    """Tells a consumer when it has reached one of its ``Recycling`` limits."""

    def __init__(self, limits: Recycling) -> None:
        self.limits = limits
        self.started = time.monotonic()
        self.claimed = 0
        self._memory_checked = 0.0

    def claims_left(self) -> int | None:
        """How many more items this process may claim (None: no ``--max-items``)."""
        if self.limits.max_items is None:
            return None
        return max(self.limits.max_items - self.claimed, 0)

    def reason(self) -> str | None:
        """Why this process is to recycle now, or None. ``--max-items``: once it has
        claimed them all (it then runs them); the others as they are reached."""
        limits, now = self.limits, time.monotonic()
        if limits.max_items is not None and self.claimed >= limits.max_items:
            return f"max-items: claimed {self.claimed} items, --max-items {limits.max_items}"
        if limits.max_age is not None and now - self.started >= limits.max_age:
            return f"max-age: ran {now - self.started:.0f} s, --max-age {limits.max_age:g}"
        if (
            limits.max_memory_mb is not None
            and now >= self._memory_checked + MEMORY_CHECK_INTERVAL
        ):
            self._memory_checked = now
            used = resident_mb()
            if used >= limits.max_memory_mb:
                return f"max-memory: {used:.0f} MB resident, --max-memory {limits.max_memory_mb:g}"
        return None


def kind(reason: str) -> str:
    """A reason's limit, as the metrics label it: max-items, max-memory or max-age."""
    return reason.split(":", 1)[0]


def resident_mb() -> float:
    """This process's resident memory now, in MB: /proc's count on Linux, else the peak
    the kernel reports (never less than now)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            pages = int(statm.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes; KB


def tell_supervisor(reason: str) -> None:
    """Write why this child recycled where its supervisor reads it (``RECYCLE_FD``), so
    that it starts another; nothing without a supervisor."""
    fd = os.environ.get(RECYCLE_FD)
    if fd is None:
        return
    with contextlib.suppress(OSError, ValueError):  # no supervisor listening
        os.write(int(fd), reason.encode()[:512])
