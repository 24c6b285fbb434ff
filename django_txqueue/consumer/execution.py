"""Running one item's handler, and what it came to (``Outcome``).

A handler runs as it is, or, registered with ``atomic=True``, in a transaction that ends
with the item's fenced acknowledgement. Whatever it raises is the item's failure, not
the consumer's: ``SystemExit`` and ``KeyboardInterrupt`` too. Except the database's own
failures: a lost connection (a server restart, a failover) or a transaction the database
refused (a deadlock, a serialization or Galera certification failure) is no fault of the
handler's, and its item goes back READY without counting an attempt (``Outcome.lost``).
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.db import DatabaseError, Error, connections, transaction

from .. import store
from ..db import dialect_for
from ..exceptions import NotJSONSerializable, Snooze
from ..models import QueueItem
from ..observe import tracing
from ..observe.logs import about
from ..validation import check_json, to_timedelta
from . import registry

# The logger name docs/tracing.md documents (and LOGGING settings name), kept from before
# this module moved into consumer/.
logger = logging.getLogger("django_txqueue.execution")


@dataclass
class Outcome:
    """What running one item's handler came to."""

    item: QueueItem
    result: Any = None
    error: str | None = None
    error_class: str = ""
    retry: bool = True
    duration: float = 0.0
    # None: the settler acknowledges a success. True or False: an atomic handler's own
    # transaction did, or was refused (the claim was taken over; its writes rolled back).
    acknowledged: bool | None = None
    # The error was the database's (``databases_failure``), not the handler's: the item
    # goes back READY with no attempt counted and no retry delay.
    lost: bool = False
    # What the handler raised, until the settler has logged it with its traceback.
    exception: BaseException | None = None
    # The retry's delay, from the handler's ``backoff`` (None: the queue's back-off).
    delay: float | timedelta | None = None
    # The handler raised ``Snooze``: the seconds until the item runs again.
    snooze: float | None = None

    def failed(self, exc: BaseException, *, retry: bool = True) -> None:
        self.exception = exc
        cls = type(exc)
        self.error = "".join(traceback.format_exception(exc))
        self.error_class = f"{cls.__module__}.{cls.__qualname__}"
        self.retry = retry


def runner() -> Callable[[registry.Handler, QueueItem], Outcome]:
    """How a consumer runs each item, chosen when it starts: ``run_handler`` where traces
    are recorded, else ``run_item``, which skips asking about tracing for each item."""
    return run_handler if tracing.enabled() else run_item


def run_handler(handle: registry.Handler, item: QueueItem) -> Outcome:
    """``run_item`` in a span of its own, with OpenTelemetry (``tracing``), which
    records what the handler raised."""
    with tracing.processing(item) as span:
        outcome = run_item(handle, item)
        if outcome.exception is not None:
            tracing.failed(span, outcome.exception, outcome.error_class)
    return outcome


def run_item(handle: registry.Handler, item: QueueItem) -> Outcome:
    """Run ``handle`` on ``item`` (in a transaction of its own if its queue's handler is
    atomic) and return what it came to."""
    started = time.monotonic()
    outcome = Outcome(item)
    try:
        if registry.is_atomic(item.queue):
            outcome.result, outcome.acknowledged = run_atomic(handle, item)
        else:
            outcome.result = checked_result(handle(item), item)
            if "_progress_held" in item.__dict__:  # report_progress writes once a second
                item.write_progress()
    except BaseException as exc:  # SystemExit or KeyboardInterrupt too: the item's failure
        lost = databases_failure(exc, item._state.db or "default")
        close_broken_connections(failed_only=True)  # else every later item fails too
        record_exception(outcome, exc, lost=lost)
    outcome.duration = time.monotonic() - started
    return outcome


def record_exception(outcome: Outcome, exc: BaseException, *, lost: bool) -> None:
    """What the handler's ``exc`` comes to: a snooze, a failed attempt (retried by its
    handler's rules, not at all for a result that is not JSON), or, ``lost`` (the
    database's failure, ``databases_failure``), the item back READY uncounted."""
    if isinstance(exc, Snooze):
        outcome.snooze = exc.seconds
        return
    if isinstance(exc, NotJSONSerializable):
        outcome.failed(exc, retry=False)  # running it again would return the same
        return
    rule = registry.retry_rule(outcome.item.queue)
    outcome.failed(exc, retry=rule.retries(exc))
    outcome.lost = lost
    if rule.backoff is not None and outcome.retry and not lost:
        outcome.delay = backoff_delay(rule.backoff, outcome.item, exc)


def backoff_delay(backoff: registry.Backoff, item: QueueItem, exc: BaseException) -> Any:
    """``backoff(attempt, exc)``, the handler's delay before the retry: seconds >= 0 or a
    timedelta. A backoff that raises or returns anything else is logged, and the queue's
    own back-off used (None): the item is retried all the same."""
    try:
        delay = backoff(item.attempts, exc)
        if isinstance(delay, timedelta) or (
            isinstance(delay, (int, float)) and not isinstance(delay, bool)
        ):
            return to_timedelta(delay, "backoff's delay")
        raise TypeError(f"backoff returned {delay!r}, not seconds or a timedelta")
    except Exception:
        logger.exception(
            "%s #%s: the handler's backoff failed; the queue's back-off is used",
            item.queue,
            item.pk,
            extra=about(item),
        )
        return None


def checked_result(result: Any, item: QueueItem) -> Any:
    if result is not None:  # None, the usual result, needs no trial serialisation
        check_json(result, f"the result of the {item.queue!r} handler", NotJSONSerializable)
    return result


def run_atomic(handle: registry.Handler, item: QueueItem) -> tuple[Any, bool]:
    """Run ``handle`` in a transaction that ends with the item's fenced acknowledgement.

    Returns the result and whether the acknowledgement was accepted. Refused (the claim
    was taken over after its lease ran out), the handler's writes roll back with it; an
    exception rolls them back too, and the item is retried as usual.
    """
    alias = item._state.db or "default"
    with transaction.atomic(using=alias):
        result = checked_result(handle(item), item)
        if "_progress_held" in item.__dict__:  # before the acknowledgement ends the claim
            item.write_progress()
        token = item.claim_token or 0
        ack = store.Ack(token, {item.pk: result}, store.claimed_dependents([item]))
        acknowledged = store.ack_many(QueueItem, alias, ack) == 1
        if not acknowledged:
            transaction.set_rollback(True, using=alias)
    if acknowledged:
        store.mark_done(item, result)
    else:
        logger.warning(
            "%s #%s: its claim was taken over; the atomic handler's writes are rolled back",
            item.queue,
            item.pk,
            extra=about(item),
        )
    return result, acknowledged


def databases_failure(exc: BaseException, alias: str) -> bool:
    """Whether ``exc`` is database ``alias``'s failure rather than the handler's: a lost
    connection (dropped here, even one still open to a server now read-only, so that
    Django reconnects, to the new primary) or a transaction the database refused."""
    if not isinstance(exc, Error):
        return False
    vendor = dialect_for(alias)
    if vendor.is_disconnect(exc):
        drop_connection(alias)
        return True
    return isinstance(exc, DatabaseError) and vendor.is_transient(exc)


def drop_connection(alias: str) -> None:
    """Close this thread's connection to ``alias``, however broken; Django reconnects on
    next use."""
    connection = connections[alias]
    try:
        connection.close()
    except Error:
        connection.connection = None


def close_if_broken(alias: str) -> None:
    """Drop this thread's connection if it can no longer be used; Django reconnects on
    next use."""
    connection = connections[alias]
    try:
        if connection.connection is not None and not connection.is_usable():
            connection.close()
    except Error:
        connection.connection = None


def close_broken_connections(failed_only: bool = False) -> None:
    """``close_if_broken`` for each connection this thread has opened; with ``failed_only``,
    only for those that have raised an error (no round trip for the others)."""
    for connection in connections.all(initialized_only=True):
        if not failed_only or connection.errors_occurred:
            close_if_broken(connection.alias)
