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
