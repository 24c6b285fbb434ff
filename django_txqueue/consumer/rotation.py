"""Which of a consumer's queues it claims from next, and when it looks for new ones.

- Its queues in turn, starting after the last one that gave items, so that a busy queue
  cannot starve the others.
- A queue whose claim came back empty is idle: passed over, at no round trip, until a
  wake-up names it (``wake``: a producer's NOTIFY or datagram, or this consumer settling
  one of its items, which may free an ordered queue's next one), the whole consumer is
  idle (its timed-out waits poll every queue, as before), or POLL_INTERVAL has passed
  (items that come due unannounced: retries, scheduled and rescued items, producers on
  other hosts). Without this, a consumer serving 50 queues with the work in one paid 49
  empty claims per batch and drained at 8% of its one-queue rate.
- With a ``probe`` (the consumer's), queues whose state is unknown (at start, after a
  timed-out wait, when their POLL_INTERVAL runs out) are looked at together first, one
  statement for all (``store.queues_with_due_items``), and only those with due items are
  claimed: an idle consumer serving 50 queues sent 50 empty claims every POLL_INTERVAL.
- A rate-limited queue whose budget is spent (its claim says until when) is held: passed
  over, wake-ups or not, until its budget has room again, and then claimed at once
  (``held``: the consumer's wait ends then).
- The ``on_commit`` calls whose committing process did not run them (``outbox``): looked
  for at start, whenever the other queues are idle, and at least every POLL_INTERVAL,
  not on every turn of a busy loop.
- Where handlers may be found for queues nobody named (Django Tasks with ``QUEUES = []``),
  a look for new queues with ready items every ``DISCOVERY_INTERVAL`` seconds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

from .. import conf, outbox
from ..api import Queue
from ..models import QueueItem
from . import registry

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
        probe: Callable[[list[str]], set[str]] | None = None,
    ) -> None:
        self.handlers = {**handlers, outbox.QUEUE: outbox.run_call}
        self.using = using
        self.discover = discover
        self.queues = {name: Queue(name, using=using) for name in self.handlers}
        self._next = 0  # position of the named queue to try first
        # Idle queues: when each is claimed again unless woken first (monotonic).
        self.idle: dict[str, float] = {}
        # Rate-limited queues whose budget is spent: when each has room again (monotonic),
        # as their claims said (``Claimer.held``, the same dict).
        self.held: dict[str, float] = {}
        # The last ``first_to_give`` passed over an idle queue: it did not claim from all.
        self.passed_over = False
        # Queues found with ready items and a handler (``discover_new``), until the
        # consumer takes note of them.
        self.found: list[str] = []
        # Given the queue names, those with due items (one statement); None: no look.
        self.probe = probe
        # Queues not known to have work or not, to look at before claiming (with a probe).
        self.unknown: set[str] = set(self.woken_for()) if probe else set()
        self._outbox_due = 0.0
        self._discovery_due = 0.0

    def woken_for(self) -> list[str]:
        """The queues whose producers' wake-ups concern this consumer: not the on_commit
        calls, which their committing process runs."""
        return [name for name in self.queues if name != outbox.QUEUE]

    def first_to_give(
        self, claim: Callable[[str], list[T]], *, woken: Iterable[str] = ()
    ) -> list[T]:
        """``claim(name)`` from the queues in turn, idle ones passed over (but those
        ``woken``), until one gives items; returns them."""
        if woken:
            self.wake(woken)
        self.found += self.discover_new()
        now = time.monotonic()
        outbox_due = now >= self._outbox_due
        if outbox_due and (items := self._claim_outbox(claim)):
            return items
        names, idle, held = self.woken_for(), self.idle, self.held
        looked = self._look(now) if self.probe is not None else set()
        self.passed_over = False
        for offset in range(len(names)):
            position = (self._next + offset) % len(names)
            name = names[position]
            if held and held.get(name, now) > now:
                self.passed_over = True
                continue
            if idle and idle.get(name, now) > now:
                # Found without due items just now counts as claimed from, not passed over.
                self.passed_over = self.passed_over or name not in looked
                continue
            items = claim(name)
            if room := held.get(name):  # until its budget has room: not idle, not drained
                self.passed_over = self.passed_over or not items
            if items:
                idle.pop(name, None)
                self._next = (position + 1) % len(names)
                return items
            if not room:
                idle[name] = now + conf.get("POLL_INTERVAL")
        return [] if outbox_due else self._claim_outbox(claim)

    def _look(self, now: float) -> set[str]:
        """Look at the queues of unknown state together (those never claimed, woken all
        at once, or whose POLL_INTERVAL ran out); those without due items become idle
        with no claim. Returns those. One such queue is claimed as it is: no saving."""
        idle = self.idle
        if not self.unknown and min(idle.values(), default=now + 1) > now:
            return set()  # a busy consumer's usual turn: nothing to look at
        unknown = self.unknown | {name for name, until in idle.items() if until <= now}
        if len(unknown) < 2:
            self.unknown.clear()
            return set()
        assert self.probe is not None  # noqa: S101 - the caller checked
        due = self.probe(sorted(unknown))
        self.unknown.clear()
        for name in unknown & due:
            idle.pop(name, None)
        empty = unknown - due
        idle.update(dict.fromkeys(empty, now + conf.get("POLL_INTERVAL")))
        return empty

    def wake(self, names: Iterable[str] | None) -> None:
        """Claim from these idle queues again on the next turn (None: from every one, or,
        with a probe, from every one that has due items)."""
        if names is None:
            self.idle.clear()
            if self.probe is not None:
                self.unknown = set(self.woken_for())
            return
        for name in names:
            self.idle.pop(name, None)

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
                found.append(name)  # it has ready items: claimed as it comes, no look
        return found
