"""What stops a consumer process: its stop signals, and the watchdog of a consumer whose
handlers run on its loop's own thread (``run_queue_consumer --concurrency 1``).

Signals (``StopSignals``): the first SIGTERM, SIGINT or SIGHUP stops the consumer
gracefully, the second ends it at once, its items left for rescue. Python runs a signal's
handler on the main thread between two bytecodes, so not while that thread is in a C call
that retries when a signal interrupts it (a query in mysqlclient, say): such a signal
waits for the call to end.

Handlers on the loop's thread save a thread switch and a hand-over per batch, but that
thread cannot enforce anything while it runs a handler: a handler past its ``TIMEOUT``, a
shutdown past ``SHUTDOWN_TIMEOUT``, a signal waiting for a C call. The ``Watchdog``, a
thread of its own, looks every ``WATCH_INTERVAL`` (and hears signals through
``signal.set_wakeup_fd``); when one of those is due while the loop's thread is in a
handler, it takes that thread's place for good (Python cannot stop a thread: the handler
runs on until the process ends) and does what the loop would have done, then ends the
process with the exit code the loop would have returned.
"""

from __future__ import annotations

import atexit
import logging
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..models import QueueItem
    from .execution import Outcome
    from .registry import Handler

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# Seconds between the watchdog's looks: how late past a TIMEOUT or SHUTDOWN_TIMEOUT it
# acts, at most; the loop's thread, between handlers, looks every turn.
WATCH_INTERVAL = 0.1
# Seconds a signal is left to Python's handler on the main thread before the watchdog,
# hearing it too, takes it as one that waits for a C call.
SIGNAL_GRACE = 0.5


class StopSignals:
    """The first stop signal calls ``stop()``, the second ends the process (128 + the
    signal's number). A signal counts once, whether Python's handler or the watchdog
    takes it first; SIGHUP stays ignored where it was (nohup)."""

    def __init__(self) -> None:
        self.stop: Callable[[], None] = lambda: None
        self.taken = 0  # signals acted on so far, by either
        self.handled = 0  # signals Python's handler has run for
        self._lock = threading.RLock()  # re-entered by a signal that arrives inside it

    def install(self, stop: Callable[[], None]) -> None:
        self.stop = stop
        for signum in STOP_SIGNALS:
            if signal.getsignal(signum) is not signal.SIG_IGN:
                signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        with self._lock:
            self.handled += 1
            if self.handled > self.taken:  # else the watchdog took this one
                self._take(self.handled, signum)

    def heard(self, nth: int, signum: int) -> None:
        """The watchdog heard the ``nth`` signal, ``signum``, ``SIGNAL_GRACE`` ago: taken
        here unless Python's handler has run for it meanwhile."""
        with self._lock:
            if self.handled < nth and self.taken < nth:
                logger.warning("signal %d taken while a handler holds the main thread", signum)
                self._take(nth, signum)

    def _take(self, nth: int, signum: int) -> None:
        self.taken = nth
        if nth > 1:
            os._exit(128 + signum)
        self.stop()


class Watchdog:
    """Watches a loop that runs handlers on its own thread (see the module's docstring).

    ``due()`` says whether the loop's thread must be relieved (a handler past its
    TIMEOUT, say); ``stopping`` past ``shutdown_timeout`` is due too. Relieved,
    ``take_over(deadline)`` does the loop's part on the watchdog's thread, the shutdown
    ending by ``deadline`` (monotonic; None: a shutdown not begun yet), and returns the
    exit code. The loop's thread runs each handler through ``watched(run)``, which never
    returns once the watchdog has taken over.
    """

    def __init__(
        self,
        *,
        due: Callable[[], bool],
        take_over: Callable[[float | None], int],
        stopping: threading.Event,
        shutdown_timeout: float,
        signals: StopSignals,
    ) -> None:
        self.due = due
        self.take_over = take_over
        self.stopping = stopping
        self.shutdown_timeout = shutdown_timeout
        self.signals = signals
        # Held by the loop's thread except while it runs a handler: whoever holds it may
        # settle and release. The watchdog takes it only from a thread in a handler.
        self._loop_free = threading.Lock()
        self._loop_free.acquire()
        self._closed = threading.Event()
        self._stop_seen: float | None = None  # when it first saw ``stopping`` (monotonic)
        self._heard: list[tuple[int, float]] = []  # signals heard: (number, when)
        self._heard_count = 0  # signals heard so far, past their grace
        self._wakeup_read, self._wakeup_write = os.pipe()
        os.set_blocking(self._wakeup_write, False)
        self._previous_wakeup: int | None = None
        self.thread = threading.Thread(target=self._watch, name="txqueue-watchdog", daemon=True)

    def start(self) -> None:
        if threading.current_thread() is threading.main_thread():  # else no signals here
            self._previous_wakeup = signal.set_wakeup_fd(
                self._wakeup_write, warn_on_full_buffer=False
            )
        self.thread.start()

    def close(self) -> None:
        """On the loop's thread, as the consumer ends: the watchdog stops watching."""
        self._closed.set()
        if self._previous_wakeup is not None:
            signal.set_wakeup_fd(self._previous_wakeup)
        os.write(self._wakeup_write, b"\0")  # ends its wait now: no signal's number
        self.thread.join()
        os.close(self._wakeup_read)
        os.close(self._wakeup_write)

    def watched(self, run: Callable[[Handler, QueueItem], Outcome]) -> Callable[..., Outcome]:
        """``run`` (a handler's run), the loop's thread free to be relieved meanwhile."""
        loop_free = self._loop_free

        def run_watched(handle: Handler, item: QueueItem) -> Outcome:
            loop_free.release()
            try:
                return run(handle, item)
            finally:
                loop_free.acquire()  # forever, once the watchdog has taken over

        return run_watched

    def _watch(self) -> None:
        while not self._closed.is_set():
            readable, _, _ = select.select([self._wakeup_read], [], [], WATCH_INTERVAL)
            now = time.monotonic()
            if readable:  # the wake-up fd carries every signal with a Python handler
                heard = os.read(self._wakeup_read, 64)
                self._heard += [(signum, now) for signum in heard if signum in STOP_SIGNALS]
            if self._is_due(now) and self._loop_free.acquire(blocking=False):
                self._relieve()

    def _is_due(self, now: float) -> bool:
        while self._heard and now - self._heard[0][1] >= SIGNAL_GRACE:
            signum, _ = self._heard.pop(0)
            self._heard_count += 1
            self.signals.heard(self._heard_count, signum)
        if self.stopping.is_set() and self._stop_seen is None:
            self._stop_seen = now
        past_shutdown = self._stop_seen is not None and (
            now - self._stop_seen > self.shutdown_timeout
        )
        return past_shutdown or self.due()

    def _relieve(self) -> None:
        """The loop's thread is in a handler for good: the loop's part, then the end."""
        code = 1
        deadline = None if self._stop_seen is None else self._stop_seen + self.shutdown_timeout
        try:
            code = self.take_over(deadline)
        except BaseException:
            logger.exception("the watchdog could not finish the consumer's shutdown")
        finally:
            # What an exit would run (logging's flush, the metrics of a --processes
            # child): os._exit runs nothing, and the loop's thread never gets to exit.
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
