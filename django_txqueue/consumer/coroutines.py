"""Async handlers: an ``async def`` handler runs as a coroutine on the consumer's event loop
(docs/async.md), at most ``concurrency`` at once, beside the handler threads of sync ones.

The loop runs on a thread of its own, started with the first async item. Each item is a
task; what they come to is handed to the main thread one loop iteration's worth at a time,
so that handlers ending together are acknowledged together. A coroutine, unlike a thread,
can be stopped: at its queue's ``TIMEOUT`` (a failed attempt with ``ItemTimeout``, and the
consumer goes on), when its item is asked to stop (``cancel()``: CANCELLED), and at the
shutdown timeout (its item goes back READY, its attempt uncounted). A handler that blocks
the loop (sync I/O in an ``async def``) is past stopping so: the main thread's watch of
``TIMEOUT`` ends the consumer then, as for a hung thread (``timeouts``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from asgiref.sync import sync_to_async
from django.db import Error, connections

from ..models import QueueItem
from ..observe import tracing
from . import registry, timeouts
from .execution import Outcome, checked_result, databases_failure, record_exception

# How often the loop looks for cancellation requests among its running items (read by the
# housekeeping thread with each heartbeat).
CANCEL_WATCH_INTERVAL = 0.1  # seconds
# At shutdown, how long the cancelled coroutines have to end before their items go back.
CANCEL_GRACE = 2.0  # seconds
# Past its TIMEOUT by this much, a coroutine that was not stopped is blocking the loop: the
# main thread's watch stops the consumer (``timeouts.overdue``).
BLOCKED_LOOP_GRACE = 1.0  # seconds

_T = TypeVar("_T")


async def arun_item(
    handle: registry.AsyncHandler, item: QueueItem, limit: float | None
) -> Outcome:
    """Await ``handle(item)``, stopped at ``limit`` seconds (None: never), and return what
    it came to, as ``execution.run_item`` does for a sync handler. A cancellation (the item
    was asked to stop, or the consumer gave up waiting for it) is its failure."""
    started = time.monotonic()
    outcome = Outcome(item)
    deadline = asyncio.timeout(limit)
    with tracing.processing(item) as span:
        try:
            async with deadline:
                outcome.result = checked_result(await handle(item), item)
            if "_progress_held" in item.__dict__:  # report_progress writes once a second
                await sync_to_async(item.write_progress, thread_sensitive=True)()
        except BaseException as exc:  # CancelledError too: the item's failure
            if deadline.expired():
                outcome = timeouts.timed_out(item, limit or 0.0)
            else:  # the database's failure, judged where the async ORM holds its connection
                alias = item._state.db or "default"
                lost = isinstance(exc, Error) and await sync_to_async(
                    databases_failure, thread_sensitive=True
                )(exc, alias)
                record_exception(outcome, exc, lost=lost)
            if outcome.exception is not None:
                tracing.failed(span, outcome.exception, outcome.error_class)
    outcome.duration = time.monotonic() - started
    return outcome


class EventLoop:
    """The loop thread: ``submit``ted items run as tasks, ``size`` at once; each, once it
    has a slot, runs only if ``begin(item)`` (False: released meanwhile), by ``run(item)``;
    their outcomes go to ``report`` in the loop iteration's batch."""

    def __init__(
        self,
        size: int,
        begin: Callable[[QueueItem], bool],
        run: Callable[[QueueItem], Awaitable[Outcome]],
        report: Callable[[list[Outcome]], None],
    ) -> None:
        self.size, self.begin, self.run, self.report = size, begin, run, report
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self.running: dict[asyncio.Task[None], QueueItem] = {}
        self.ended: list[Outcome] = []  # to report at the end of this loop iteration
        self.abandoning = False
        self.abandoned: list[QueueItem] = []
        self._slots: asyncio.Semaphore

    def submit(self, items: list[QueueItem]) -> None:
        """Run these items (from any thread)."""
        if self.loop is None:
            self._start()
        assert self.loop is not None  # noqa: S101 - made by _start
        # In a context of its own, not the caller's (``_on_loop`` says why).
        self.loop.call_soon_threadsafe(self._schedule, items, context=contextvars.Context())

    def _on_loop(self, coroutine: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        """Run ``coroutine`` on the loop (from another thread) in a context of its own.

        Handed over in the caller's context (``run_coroutine_threadsafe`` alone), it would
        carry asgiref's record of the caller's thread, which asgiref moves onto the loop's
        thread after a first ``sync_to_async`` call: in a consumer started inside
        ``async_to_sync`` (as Django's own Tasks tests start one), the handlers' next
        thread-sensitive calls would go to that thread, which waits for the consumer."""
        assert self.loop is not None  # noqa: S101 - made by _start
        return contextvars.Context().run(asyncio.run_coroutine_threadsafe, coroutine, self.loop)

    def _start(self) -> None:
        started = threading.Event()

        def serve() -> None:
            self.loop = asyncio.new_event_loop()
            self._slots = asyncio.Semaphore(self.size)
            self.loop.create_task(self._watch_cancel_requests())
            started.set()
            try:
                self.loop.run_forever()
            finally:  # the cancel watch, and anything a blocked handler left behind
                left = asyncio.all_tasks(self.loop)
                for task in left:
                    task.cancel()
                self.loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
                self.loop.close()

        self.thread = threading.Thread(target=serve, name="txqueue-event-loop", daemon=True)
        self.thread.start()
        started.wait()

    def _schedule(self, items: list[QueueItem]) -> None:
        assert self.loop is not None  # noqa: S101 - on the loop
        for item in items:
            self.loop.create_task(self._in_slot(item))

    async def _in_slot(self, item: QueueItem) -> None:
        async with self._slots:
            if self.abandoning or not self.begin(item):
                return
            task = asyncio.current_task()
            assert task is not None  # noqa: S101 - a task runs this
            self.running[task] = item
            try:
                outcome = await self.run(item)
            finally:
                del self.running[task]
            if self.abandoning and isinstance(outcome.exception, asyncio.CancelledError):
                self.abandoned.append(item)
                return
            if not self.ended:
                asyncio.get_running_loop().call_soon(self._report_ended)
            self.ended.append(outcome)

    def _report_ended(self) -> None:
        ended, self.ended = self.ended, []
        if ended:
            self.report(ended)

    async def _watch_cancel_requests(self) -> None:
        """Cancel the tasks whose item was asked to stop (the heartbeat reads the requests
        onto the items)."""
        cancelled: set[asyncio.Task[None]] = set()
        while True:
            await asyncio.sleep(CANCEL_WATCH_INTERVAL)
            cancelled &= set(self.running)
            for task, item in list(self.running.items()):
                if item.cancel_requested_at is not None and task not in cancelled:
                    cancelled.add(task)
                    task.cancel()

    def abandon(self) -> list[QueueItem]:
        """At the shutdown timeout (from the main thread): cancel the running coroutines,
        start no more, report what ended before, and return the items of those cancelled,
        for the caller to put back READY."""
        if self.loop is None or self.loop.is_closed():
            return []
        future = self._on_loop(self._abandon())
        try:
            return future.result(timeout=CANCEL_GRACE + 1.0)
        except TimeoutError:  # the loop is blocked: its items stay for the rescue
            return []

    async def _abandon(self) -> list[QueueItem]:
        self.abandoning = True
        tasks = list(self.running)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=CANCEL_GRACE)
        self._report_ended()
        return self.abandoned

    def close(self) -> None:
        """Stop the loop (from the main thread), once nothing runs on it, and close the
        connections its handlers' async ORM calls opened (on the thread Django runs them)."""
        if self.loop is None or self.loop.is_closed():
            return
        closing = sync_to_async(connections.close_all, thread_sensitive=True)()
        with contextlib.suppress(Exception):  # a loop blocked by a hung handler: left
            self._on_loop(closing).result(timeout=CANCEL_GRACE)
        self.loop.call_soon_threadsafe(self.loop.stop)
        if self.thread is not None:
            self.thread.join(timeout=CANCEL_GRACE)
