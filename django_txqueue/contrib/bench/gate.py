"""The drain's start line: every consumer process claims its first batch, then waits at
the gate until the bench opens it, so that no process's start-up (Django's set-up, the
connection, the system checks: half a second each, longer with many at once on few
cores) is timed, and none drains alone while the others are still starting.

A directory: a consumer arrives by writing ``ready.<pid>`` and waits for ``open``. Files,
so that forked children and ``run_queue_consumer`` processes wait the same way; the
bench's handler process finds the directory in ``TXQUEUE_BENCH_GATE``, beside the
bench queue's name in ``TXQUEUE_BENCH_QUEUE`` (read by the app's ``queues.py``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

GATE_VARIABLE = "TXQUEUE_BENCH_GATE"
QUEUE_VARIABLE = "TXQUEUE_BENCH_QUEUE"
POLL = 0.0005  # seconds between looks at the gate: a start at most this late
WAIT_LIMIT = 600.0  # a consumer whose gate never opens (the bench died) stops waiting


class Gate:
    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else Path(tempfile.mkdtemp("-txqueue-bench"))

    def arrive(self) -> None:
        """Say this process is ready, and wait until the gate opens."""
        (self.path / f"ready.{os.getpid()}").touch()
        deadline = time.monotonic() + WAIT_LIMIT
        opened = self.path / "open"
        while not opened.exists() and time.monotonic() < deadline:
            time.sleep(POLL)

    def arrived(self, pid: int | None) -> bool:
        return pid is not None and (self.path / f"ready.{pid}").exists()

    def open(self) -> None:
        (self.path / "open").touch()

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def at_first_call(gate: Gate | None, handle: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``handle``, whose first call in this process waits at ``gate`` first."""
    waiting = [gate] if gate is not None else []

    def handler(item: Any) -> Any:
        if waiting:
            waiting.pop().arrive()
        return handle(item)

    return handler


def from_environment() -> Gate | None:
    """The gate the bench gave this consumer process, if any."""
    path = os.environ.get(GATE_VARIABLE)
    return Gate(path) if path else None
