"""``run_queue_consumer --processes N``: N consumer processes under one supervisor.

A child that dies (exits non-zero) is started again (after a pause that grows while children keep
dying young, so a crash loop cannot spin); one that recycled (``--max-items``, ``--max-memory``,
``--max-age``: it exits 0 having said so through a pipe, ``recycling.RECYCLE_FD``) at once, as
is one that stopped a handler past its queue's TIMEOUT (it exits ``ItemTimeout.EXIT_CODE``).
SIGTERM/SIGINT are passed on to every child, which stops gracefully; a second signal is passed
on too, stopping them at once. The loop passes them on, not the signal handler, so a child
started as a signal arrived (replacing one that had just exited) gets it as well. Children
run in their own sessions, so a terminal's Ctrl-C reaches them only through the supervisor,
once (twice would stop them at once); SIGHUP is passed on too, unless ignored.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from types import FrameType

from ..exceptions import ItemTimeout
from .recycling import RECYCLE_FD

logger = logging.getLogger(__name__)

YOUNG_DEATH = 5.0  # seconds: a child dying sooner than this counts as a crash loop
MAX_RESTART_PAUSE = 30.0


class Supervisor:
    def __init__(self, argv: list[str], processes: int) -> None:
        self.argv = argv
        self.processes = processes
        self.children: list[tuple[subprocess.Popen[bytes], float]] = []
        self.received: list[int] = []  # the signals to pass on, in order
        self.passed_on: dict[int, int] = {}  # each child's pid: how many of them it was sent
        self.restart_pause = 0.0
        self.recycles = 0
        # Each running child's end of the pipe it says it recycled through.
        self.pipes: dict[int, int] = {}

    def run(self) -> int:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self.on_signal)
        if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:  # nohup: children ignore it
            signal.signal(signal.SIGHUP, self.on_signal)  # a closed terminal: not in its group
        self.children = [self.spawn() for _ in range(self.processes)]
        while self.children:
            time.sleep(0.2)
            checked = [self.check(child, born) for child, born in self.children]
            self.children = [entry for entry in checked if entry is not None]
            self.pass_on_signals()
        return 0

    def pass_on_signals(self) -> None:
        """Send each running child the signals received that it has not been sent yet."""
        for child, _ in self.children:
            for signum in self.received[self.passed_on.get(child.pid, 0) :]:
                if child.poll() is None:
                    child.send_signal(signum)
            self.passed_on[child.pid] = len(self.received)

    def spawn(self) -> tuple[subprocess.Popen[bytes], float]:
        read_end, write_end = os.pipe()
        os.set_blocking(read_end, False)
        try:
            # Own session: signals sent to the supervisor's process group (Ctrl-C) skip it.
            child = subprocess.Popen(  # noqa: S603 - our own argv
                self.argv,
                start_new_session=True,
                pass_fds=(write_end,),
                env={**os.environ, RECYCLE_FD: str(write_end)},
            )
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)  # the child's now: the read end sees its exit as the end
        self.pipes[child.pid] = read_end
        logger.info("started consumer process %d", child.pid)
        return child, time.monotonic()

    def recycled(self, pid: int) -> str:
        """Why the exited child ``pid`` recycled, as it wrote it ("" if it did not)."""
        read_end = self.pipes.pop(pid, None)
        if read_end is None:
            return ""
        try:
            with contextlib.suppress(BlockingIOError):
                return os.read(read_end, 4096).decode(errors="replace")
            return ""
        finally:
            os.close(read_end)

    def check(
        self, child: subprocess.Popen[bytes], born: float
    ) -> tuple[subprocess.Popen[bytes], float] | None:
        code = child.poll()
        if code is None:
            return child, born
        reason = self.recycled(child.pid)
        self.passed_on.pop(child.pid, None)
        if code == 0 and reason and not self.received:
            self.recycles += 1
            logger.info("consumer process %d recycled (%s); starting another", child.pid, reason)
            return self.spawn()
        if self.received or code == 0:
            return None  # stopping, or a --burst run that drained its queues
        if code == ItemTimeout.EXIT_CODE:  # it stopped a hung handler: its thread is lost
            logger.warning(
                "consumer process %d stopped a handler past its TIMEOUT; starting another",
                child.pid,
            )
            return self.spawn()
        lived = time.monotonic() - born
        self.restart_pause = (
            min(max(self.restart_pause * 2, 1.0), MAX_RESTART_PAUSE) if lived < YOUNG_DEATH else 0
        )
        logger.warning(
            "consumer process %d exited with %s after %.0f s; restarting in %.0f s",
            child.pid,
            code,
            lived,
            self.restart_pause,
        )
        time.sleep(self.restart_pause)
        if self.received:
            return None  # told to stop during the pause: none is started to be stopped
        return self.spawn()

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only noted here: run()'s loop passes it on, to the children it holds by then.
        self.received.append(signum)


def child_argv(argv: list[str] | None = None) -> list[str]:
    """This command line without ``--processes``, to start one consumer per child.

    ``argv`` is what followed the interpreter (default: ``sys.orig_argv[1:]``, which keeps
    ``-m django``: ``sys.argv[0]`` would be django/__main__.py, and run as a script that
    puts django/ on ``sys.path``, where its ``http`` package hides the standard library's).
    """
    args = list(sys.orig_argv[1:] if argv is None else argv)
    kept: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--processes":
            skip = True
        elif not arg.startswith("--processes="):
            kept.append(arg)
    return [sys.executable, *kept]
