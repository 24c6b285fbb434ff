"""Exceptions raised by django-txqueue. Imports nothing from the package."""

from __future__ import annotations

from typing import Any


class NotJSONSerializable(TypeError):
    """A handler's result or a task's return value that JSON cannot hold.

    The item fails at once: running the same code again would return the same value.
    """


class QueueFull(Exception):
    """Raised by enqueue on a bounded queue (``MAX_SIZE``); nothing was written.

    ``item`` is the unsaved item that did not fit, ``current_size`` the number of
    unfinished items the queue held.
    """

    def __init__(self, item: Any, current_size: int) -> None:
        self.item = item
        self.current_size = current_size
        super().__init__(
            f"queue {getattr(item, 'queue', '?')!r} is full: {current_size} unfinished items"
        )


class Snooze(Exception):  # noqa: N818  (a request, as Oban and River name it, not an error)
    """Raised by a handler (or ``item.snooze(seconds)``): run the item again in
    ``seconds`` without using an attempt. Past its queue's ``MAX_SNOOZES`` a snooze uses
    one, so that nothing snoozes forever."""

    def __init__(self, seconds: float) -> None:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0:
            raise ValueError(f"Snooze takes seconds, a number >= 0, not {seconds!r}")
        self.seconds = float(seconds)
        super().__init__(f"snoozed for {self.seconds:g} s")


class ItemTimeout(Exception):  # noqa: N818  (named as the issue and the docs name it)
    """A handler ran past its queue's ``TIMEOUT``: the consumer stopped it, and its item's
    attempt failed with this (``error_class`` ``django_txqueue.ItemTimeout``)."""

    # The class as items record it: importable from the package, as it is documented.
    NAME = "django_txqueue.ItemTimeout"
    # The exit code of a consumer that stopped such a handler (``consumer.timeouts``):
    # EX_TEMPFAIL of sysexits.h ("a temporary failure: try again"), distinct from a
    # crash's 1 and a signal's 128 + N. Here, where a supervisor reads it without Django.
    EXIT_CODE = 75
