"""Flows in several steps, inserted in the producer's transaction (docs/flows.md).

``step`` is one item to be; ``chain(a, b, c)`` runs each part after the previous one;
``group(a, b, then=c)`` runs the parts side by side and ``then`` after all of them. Parts
nest. ``.enqueue()`` on any of them writes the whole flow at once: its items, WAITING
where they wait for others, and the edges between them, in a few statements (one INSERT
per run of steps alike, then the edges), and returns the ``Flow``.
"""

from __future__ import annotations

import functools
import itertools
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from django.core.signals import setting_changed
from django.dispatch import receiver

from . import conf, store
from .api import Queue, home_database
from .consumer.wakeup import wake_local_consumers
from .models import QueueBound, QueueItem
from .observe import tracing
from .status import Status
from .validation import check_json


@dataclass(frozen=True)
class Flow:
    """The items of one flow: ``id``, and ``items`` in the order they were written
    (``Flow.of`` reads them back in enqueue order)."""

    id: uuid.UUID
    items: list[QueueItem] = field(repr=False)

    @classmethod
    def of(cls, item: QueueItem) -> Flow:
        """The flow ``item`` belongs to (ValueError if it belongs to none)."""
        if item.flow is None:
            raise ValueError(f"item {item.pk} belongs to no flow")
        items = QueueItem.objects.using(item._state.db).in_flow(item.flow).order_by("pk")
        return cls(item.flow, list(items))

    def counts(self) -> dict[Status, int]:
        """How many of the flow's items are in each status, read now; statuses with none
        left out."""
        items = QueueItem.objects.using(self.items[0]._state.db if self.items else None)
        rows = items.in_flow(self.id).values_list("status")
        found = Counter(status for (status,) in rows)
        return {Status(status): n for status, n in sorted(found.items())}


class Part:
    """A step, chain or group: ``heads`` run first, ``tails`` end it."""

    def lay_out(
        self, steps: list[Step], waits: dict[int, list[int]]
    ) -> tuple[list[int], list[int]]:
        """Append this part's steps to ``steps``, in the flow's order, and record in
        ``waits`` ({a step's index: the indices of the steps it waits for}) what waits
        for what inside it; returns its heads' indices and its tails'. One pass, by
        index: a group of a thousand steps is walked once. (The lists returned are not
        changed by the caller: a step returns one list as both.)"""
        raise NotImplementedError

    def enqueue(self, using: str | None = None) -> Flow:
        """Insert the whole flow in the caller's transaction: its items (READY where they
        wait for nothing) and the edges between them. ``using``: the database (by
        default the first step's queue's); every step's queue must live there."""
        steps: list[Step] = []
        # Lists only for the steps that wait: a group's thousand others need none (each
        # container made here is one more for the garbage collector to walk).
        waits: dict[int, list[int]] = {}
        self.lay_out(steps, waits)
        if len(set(map(id, steps))) != len(steps):
            raise ValueError("a step appears twice in this flow; make a new step() for each")
        alias = using or home_database(steps[0].queue)
        queues = {q: conf.queue_options(q) for q in dict.fromkeys(s.queue for s in steps)}
        elsewhere = [q for q in queues if using is None and home_database(q) != alias]
        if elsewhere:
            raise ValueError(
                f"queue {elsewhere[0]!r} lives on another database than {steps[0].queue!r}: "
                "a flow lives on one database (pass using=, or place the queues together)"
            )
        payloads = checked_payloads(steps)
        dependents = Counter(itertools.chain.from_iterable(waits.values()))
        flow = uuid.uuid4()
        # Steps alike but for their payload (their checked fields shared, ``step_fields``)
        # become rows alike, written by one INSERT: one run of indices each.
        alike: dict[tuple[int, int, int], list[int]] = {}
        for n, s in enumerate(steps):
            key = (id(s.fields), len(waits.get(n, ())), dependents.get(n, 0))
            alike.setdefault(key, []).append(n)
        trace_context = tracing.current_context()  # the enqueue's, as enqueue() takes it
        runs = [
            (steps[run[0]].values(flow, waiting_for, count, trace_context), run)
            for (_, waiting_for, count), run in alike.items()
        ]
        items = store.enqueue_flow(
            QueueItem,
            alias,
            runs,
            payloads,
            waits,
            bounds={q: o["MAX_SIZE"] for q, o in queues.items() if o["MAX_SIZE"] is not None},
            bound_model=QueueBound,
            fair={q for q, o in queues.items() if o["FAIR"]},
        )
        for queue in queues:
            wake_local_consumers(queue, alias)
        return Flow(flow, items)


class Step(Part):
    """One item to be: ``queue``, ``payload`` and ``enqueue``'s options."""

    def __init__(self, queue: str, payload: Any = None, **options: Any) -> None:
        self.queue, self.payload = queue, payload
        if not options:  # most steps: nothing to check but the queue's own fields
            self.fields = step_fields(queue, ())
            return
        if "after" in options:
            raise TypeError("a step waits for the parts before it in its flow, not after=")
        if options.get("dedup_key") is not None:
            raise ValueError("dedup_key names one item; enqueue such items one at a time")
        # Bad options refused now, by the builder; the payloads are checked by the
        # enqueue, all at once (``checked_payloads``).
        given = tuple(options.items())
        try:
            hash(given)
        except TypeError:  # an option that cannot be a key: checked here, uncached
            self.fields = step_fields.__wrapped__(queue, given)
        else:
            self.fields = step_fields(queue, given)

    def __repr__(self) -> str:
        return f"step({self.queue!r}, {self.payload!r})"

    def lay_out(
        self, steps: list[Step], waits: dict[int, list[int]]
    ) -> tuple[list[int], list[int]]:
        me = [len(steps)]
        steps.append(self)
        return me, me

    def values(
        self, flow: uuid.UUID, waiting_for: int, dependents: int, trace_context: Any = None
    ) -> dict[str, Any]:
        """The item's fields but the payload, waiting for ``waiting_for`` items and waited
        for by ``dependents``."""
        traced = {} if trace_context is None else {"trace_context": trace_context}
        return {
            **self.fields,
            **traced,
            "flow": flow,
            "status": Status.WAITING if waiting_for else Status.READY,
            "waiting_for": waiting_for,
            "dependent_count": dependents,
        }


class Chain(Part):
    def __init__(self, parts: Sequence[Part]) -> None:
        self.parts = list(parts)

    def lay_out(
        self, steps: list[Step], waits: dict[int, list[int]]
    ) -> tuple[list[int], list[int]]:
        heads: list[int] = []
        tails: list[int] = []
        for part in self.parts:
            part_heads, part_tails = part.lay_out(steps, waits)
            if tails:  # the first part waits for nothing: no list for its heads
                for head in part_heads:
                    waits.setdefault(head, []).extend(tails)
            heads, tails = heads or part_heads, part_tails
        return heads, tails


class Group(Part):
    def __init__(self, parts: Sequence[Part], then: Part | None) -> None:
        self.parts, self.then = list(parts), then

    def lay_out(
        self, steps: list[Step], waits: dict[int, list[int]]
    ) -> tuple[list[int], list[int]]:
        heads: list[int] = []
        tails: list[int] = []
        for part in self.parts:
            part_heads, part_tails = part.lay_out(steps, waits)
            heads += part_heads
            tails += part_tails
        if self.then is None:
            return heads, tails
        then_heads, then_tails = self.then.lay_out(steps, waits)
        for head in then_heads:
            waits.setdefault(head, []).extend(tails)
        return heads, then_tails


@functools.lru_cache(maxsize=256)
def step_fields(queue: str, options: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    """The fields but the payload of a step of ``queue`` with ``options``, checked (never
    changed: each row copies them). Kept per queue and options, until the settings
    change: the steps of a big group are alike, and their checks cost more than all
    else in building them. Without the trace context, which the enqueue takes (one for
    the flow)."""
    fields = Queue(queue).values(None, **dict(options))
    fields.pop("trace_context", None)
    return fields


@receiver(setting_changed)
def _settings_changed(setting: str, **kwargs: Any) -> None:
    if setting in ("TXQUEUE", "DATABASES", "DATABASE_ROUTERS"):
        step_fields.cache_clear()


def checked_payloads(steps: list[Step]) -> list[Any]:
    """The steps' payloads, checked as JSON in one pass (one per step costs a
    1,000-step group a tenth of its enqueue); a TypeError names the first step's queue
    whose payload is not JSON, as ``enqueue()`` would."""
    payloads = [s.payload for s in steps]
    try:
        check_json(payloads, "payloads")
    except TypeError:
        for s in steps:
            check_json(s.payload, f"payload for queue {s.queue!r}")
        raise
    return payloads


def step(queue: str, payload: Any = None, **options: Any) -> Step:
    """One item to be in a flow, with ``enqueue``'s options (not ``after``: its place in
    the flow says what it waits for)."""
    return Step(queue, payload, **options)


def chain(*parts: Part) -> Chain:
    """Each part after the previous one has ended."""
    return Chain(_parts(parts, "chain"))


def group(*parts: Part, then: Part | None = None) -> Group:
    """The parts side by side; ``then`` after all of them."""
    if then is not None and not isinstance(then, Part):
        raise TypeError(f"then must be a step, chain or group, not {type(then).__name__}")
    return Group(_parts(parts, "group"), then)


def _parts(parts: Sequence[Any], what: str) -> list[Part]:
    if not parts:
        raise ValueError(f"{what}() needs at least one part")
    for part in parts:
        if not isinstance(part, Part):
            raise TypeError(f"{what}() takes steps, chains and groups, not {type(part).__name__}")
    return list(parts)
