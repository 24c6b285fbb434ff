"""Time limits that stop a handler (a queue's ``TIMEOUT``, docs/limits.md).

Python cannot stop a thread, and a hung handler holds its thread for good (on a socket with
no timeout, in a C call). So a consumer whose handler runs past its queue's ``TIMEOUT``
settles that item as a failed attempt with ``ItemTimeout`` (retried or FAILED by the usual
rules, the handler's ``retry_on``, ``discard_on`` and ``backoff`` included), and stops as on
SIGTERM: it claims nothing more, releases the items no handler has started, gives the
running ones its shutdown timeout, and exits ``ITEM_TIMEOUT_EXIT``. Its supervisor
(``--processes``) starts another at once; a single process is for its service manager to
start again (systemd's ``Restart=on-failure``, Kubernetes' ``restartPolicy``). A handler
that wants to stop cleanly first reads ``item.time_left()``.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Iterable

from ..exceptions import ItemTimeout
from ..models import QueueItem
from . import registry
from .execution import Outcome, backoff_delay

# The exit code of a consumer that stopped a handler past its TIMEOUT (75, EX_TEMPFAIL).
ITEM_TIMEOUT_EXIT = ItemTimeout.EXIT_CODE

# Set on an item as its handler starts: the time.monotonic() its TIMEOUT ends at, when the
# consumer stops it (later for a coroutine, which stops itself first), and the thread that
# runs it (``QueueItem.time_left()`` reads the first).
DEADLINE = "_handler_deadline"
STOP_AT = "_handler_stop_at"
THREAD = "_handler_thread"


def started(item: QueueItem, timeout: float, now: float, grace: float = 0.0) -> None:
    """Note on ``item`` that its handler starts ``now`` on this thread, with ``timeout``;
    the consumer stops it ``grace`` seconds after that."""
    item.__dict__[DEADLINE] = now + timeout
    item.__dict__[STOP_AT] = now + timeout + grace
    item.__dict__[THREAD] = threading.get_ident()


def ended(item: QueueItem) -> None:
    """Note on ``item`` that its handler has returned: never overdue after."""
    item.__dict__.pop(STOP_AT, None)


def overdue(held: Iterable[tuple[QueueItem, float | None]]) -> list[QueueItem]:
    """The ``held`` items whose handler has run past its deadline (and grace)."""
    now = time.monotonic()
    return [
        item for item, began in held if began is not None and now > item.__dict__.get(STOP_AT, now)
    ]


def timed_out(item: QueueItem, timeout: float) -> Outcome:
    """What a handler stopped past ``timeout`` came to: a failed attempt with
    ``ItemTimeout``, retried or not by its handler's rules, with where its thread was."""
    exc = ItemTimeout(
        f"the {item.queue!r} handler ran past its TIMEOUT of {timeout:g} s: the consumer "
        "stopped it"
    )
    rule = registry.retry_rule(item.queue)
    outcome = Outcome(item, duration=timeout)
    outcome.failed(exc, retry=rule.retries(exc))
    outcome.error_class = ItemTimeout.NAME
    if stack := thread_stack(item.__dict__.get(THREAD)):  # as a traceback: the error last
        outcome.error = f"Where its thread was (most recent call last):\n{stack}{outcome.error}"
    if rule.backoff is not None and outcome.retry:
        outcome.delay = backoff_delay(rule.backoff, item, exc)
    return outcome


def thread_stack(ident: int | None) -> str:
    """The stack of the running thread ``ident`` ("" if it is gone)."""
    frame = sys._current_frames().get(ident) if ident is not None else None
    return "" if frame is None else "".join(traceback.format_stack(frame))
