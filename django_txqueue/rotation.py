"""Which of a consumer's queues it claims from next, and when it looks for new ones.

- Its queues in turn, starting after the last one that gave items, so that a busy queue
  cannot starve the others.
- The ``on_commit`` calls whose committing process did not run them (``outbox``): looked
  for at start, whenever the other queues are idle, and at least every POLL_INTERVAL,
  not on every turn of a busy loop.
- Where handlers may be found for queues nobody named (Django Tasks with ``QUEUES = []``),
  a look for new queues with ready items every ``DISCOVERY_INTERVAL`` seconds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from . import conf, outbox, registry
from .api import Queue
from .models import QueueItem

logger = logging.getLogger(__name__)

# Seconds between looks for new queues.
DISCOVERY_INTERVAL = 5.0

T = TypeVar("T")


class Rotation:
    """The queues of one consumer on database ``using``, each with its handler.

    ``discover``, if given, is asked for a handler for each queue with ready items that
    has none yet (None: not ours). Every consumer also runs the orphaned ``on_commit``
    calls.
    """

    def __init__(
        self,
        handlers: dict[str, registry.Handler],
        using: str,
        discover: Callable[[str], registry.Handler | None] | None = None,
    ) -> None:
        self.handlers = {**handlers, outbox.QUEUE: outbox.run_call}
        self.using = using
        self.discover = discover
        self.queues = {name: Queue(name, using=using) for name in self.handlers}
        self._next = 0  # position of the named queue to try first
        self._outbox_due = 0.0
        self._discovery_due = 0.0

    def woken_for(self) -> list[str]:
        """The queues whose producers' wake-ups concern this consumer: not the on_commit
        calls, which their committing process runs."""
        return [name for name in self.queues if name != outbox.QUEUE]

    def first_to_give(self, claim: Callable[[str], list[T]]) -> list[T]:
        """``claim(name)`` from the queues in turn until one gives items; returns them."""
        outbox_due = time.monotonic() >= self._outbox_due
        if outbox_due and (items := self._claim_outbox(claim)):
            return items
        names = self.woken_for()
        for offset in range(len(names)):
            position = (self._next + offset) % len(names)
            if items := claim(names[position]):
                self._next = (position + 1) % len(names)
                return items
        return [] if outbox_due else self._claim_outbox(claim)

    def _claim_outbox(self, claim: Callable[[str], list[T]]) -> list[T]:
        self._outbox_due = time.monotonic() + conf.get("POLL_INTERVAL")
        return claim(outbox.QUEUE)

    def discover_new(self) -> list[str]:
        """Queues found since the last look (if one is due) that now have a handler."""
        if self.discover is None or time.monotonic() < self._discovery_due:
            return []
        self._discovery_due = time.monotonic() + DISCOVERY_INTERVAL
        found = []
        for name in QueueItem.objects.using(self.using).ready_queue_names():
            if name not in self.queues and (handler := self.discover(name)) is not None:
                logger.info("consuming queue %s", name)
                self.handlers[name] = handler
                self.queues[name] = Queue(name, using=self.using)
                found.append(name)
        return found
