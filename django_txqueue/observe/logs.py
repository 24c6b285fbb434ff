"""What a long-running consumer logs and keeps of logs: errors on one line, and Django's
DEBUG query log emptied as it goes, so that its memory stays flat."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db import connections


def forget_queries() -> None:
    """Empty this thread's connections' query logs. With DEBUG=True Django logs every
    query, up to 9,000 a connection, and only a request's start clears the log: a
    consumer's threads would each hold thousands (about 55 MB more after 100,000 items).
    A log being captured (``CaptureQueriesContext``, ``assertNumQueries``) is kept.
    Without DEBUG nothing is logged but what is captured: nothing to do, every turn."""
    if not settings.DEBUG:
        return
    for connection in connections.all(initialized_only=True):
        if not connection.force_debug_cursor:
            connection.queries_log.clear()


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """``count`` and ``noun``, in the plural but for one: "1 consumer", "2 consumers"."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"


def one_line(exc: BaseException) -> str:
    """The error's message on one line (PostgreSQL's span several)."""
    return " ".join(str(exc).split())


def about(item: Any) -> dict[str, Any]:
    """The ``extra`` of a log line about ``item``, which JSON formatters and Sentry's
    logging integration pick up: its queue, its id, the attempt (1 on the first run) and
    the consumer running it (its identity, the ``pid`` its claim wrote). Read before a
    settling write changes them (a release takes the attempt back, clears the pid)."""
    return {
        "queue": item.queue,
        "item_id": item.pk,
        "attempt": item.attempts,
        "consumer": item.pid,
    }
