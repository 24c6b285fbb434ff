"""The queue against a model of it: random sequences of the public API, checked at every step.

Hypothesis's stateful testing plays random sequences of ``enqueue`` and ``enqueue_many``,
``Queue.claim``, ``Queue.dequeue``, the consumer loop's ``Queue.claims.ack_and_claim``, the
acknowledgements (``ack``, ``retry``, ``fail``, ``release``: on live claims and on stale
ones), the passing of time, rescue (``Queue.requeue_stuck`` and ``txqueue_requeue_stuck``),
the admin's requeue and mark failed, ``Queue.purge``, and ``Queue.pause`` and ``resume``
(a paused queue's claims take nothing), on queues of tests/settings.py: a
plain one, "bounded" (MAX_SIZE 3), "fair", "ordered", "fair-ordered" and "limited"
(MAX_IN_FLIGHT_PER_KEY 2). ``Model`` says in plain Python what each step should do, from
the docs (claims.md, queues.md, producing.md) and the README, never from the package's
code; after every step the database must
hold what the model holds, row for row, and the public reads (``count``, ``stats``,
``peek``) must agree with it. Besides, straight from the rows: at most one unfinished item
per dedup key, an ordered key's items in flight within its limit, a bounded queue within
``MAX_SIZE``, and one fencing token per claim.

Time never passes by sleeping: claims compare with the database clock, so "time passes"
moves every time in the table back (leases run out, scheduled items come due, finished items
grow old), and "a lease runs out" moves one item's lease into the past, as
``tests.helpers.expire`` does.

Profiles (``TXQUEUE_MODEL_PROFILE``): ``ci`` (the default, for every run of the suite) and
``long``, on demand. Run with ``-s`` to see how many steps ran.
"""

from __future__ import annotations

import datetime as dt
import io
import itertools
import os
from collections import Counter
from dataclasses import dataclass

import pytest
from django.core.management import call_command
from django.db import connection
from django.db.models import BooleanField, Case, F, Q, Value, When
from django.db.models.functions import Now
from django.utils import timezone
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from django_txqueue import Queue, QueueFull, QueueItem, Status, enqueue, enqueue_many
from django_txqueue.models import QueueBound, QueuePause
from django_txqueue.store import Ack

from .helpers import expire, strategies
from .test_housekeeping import housekeeping

READY, IN_PROGRESS, DONE, FAILED = Status.READY, Status.IN_PROGRESS, Status.DONE, Status.FAILED
CANCELLED = Status.CANCELLED
FINISHED = (DONE, FAILED, CANCELLED)

# A fair queue's served items: a cancelled one is not (README, "Cancelling items").
SERVED = (IN_PROGRESS, DONE, FAILED)

HOUR = dt.timedelta(hours=1)
# One passing of time: past every lease (300 s by default), every delay the test asks
# for and every retry back-off (capped at RETRY_MAX_DELAY, an hour), and past OLD.
ELAPSED = 3 * HOUR
# purge(older_than=OLD) deletes exactly the items finished before the last passing of
# time: they are ELAPSED old, the others a few seconds at most.
OLD = HOUR
# Every queue's MAX_ATTEMPTS (the default: tests/settings.py overrides it for none of ours).
DEFAULT_MAX_ATTEMPTS = 5


@dataclass(frozen=True)
class Shape:
    """What tests/settings.py makes of a queue."""

    max_size: int | None = None  # MAX_SIZE
    fair: bool = False  # FAIR
    per_key: int | None = None  # ORDERED is 1; MAX_IN_FLIGHT_PER_KEY

    @property
    def needs_key(self) -> bool:
        return self.fair or self.per_key is not None


QUEUES = {
    "plain": Shape(),
    "bounded": Shape(max_size=3),
    "fair": Shape(fair=True),
    "ordered": Shape(per_key=1),
    "fair-ordered": Shape(fair=True, per_key=1),
    "limited": Shape(per_key=2),
}

# Few values, so that items share keys, dedup keys and priorities; repeated values come up
# more often. Shrinking goes to the first one.
KEYS = ["a", "b", "c", "a", "b", None]  # None: refused by the queues that need a key
DEDUP_KEYS = [None, None, None, "d1", "d2"]
PRIORITIES = [0, 1, -1]
MAX_ATTEMPTS = [None, 1, 2]
# When an item is due: "now" (the default), "past" (run_at an hour ago), "delay" (delay
# of an hour), "later" (run_at in an hour).
SCHEDULES = ["now", "now", "past", "delay", "later"]
SETTLEMENTS = ["ack", "retry", "retry later", "retry backoff", "fail", "release"]
RESCUES = ["Queue.requeue_stuck", "command", "command all"]
CANCELS = ["Queue.cancel", "QueueItem.cancel", "a handler's own item"]
OPTIONS = st.fixed_dictionaries(
    {
        "priority": st.sampled_from(PRIORITIES),
        "key": st.sampled_from(KEYS),
        "dedup_key": st.sampled_from(DEDUP_KEYS),
        "max_attempts": st.sampled_from(MAX_ATTEMPTS),
        "schedule": st.sampled_from(SCHEDULES),
    }
)

# -- profiles --------------------------------------------------------------------------

COMMON = {
    "deadline": None,  # database latency varies, and a step may compile a new claim
    # A few dozen queries per step: slow by Hypothesis's measure, and meant to be.
    "suppress_health_check": [HealthCheck.too_slow],
    "print_blob": True,
}
# ci: about 1,100 steps, 10 to 20 s per database on a small machine; long: about 20,000.
settings.register_profile("txqueue-model-ci", max_examples=20, stateful_step_count=50, **COMMON)
settings.register_profile("txqueue-model-long", max_examples=300, stateful_step_count=80, **COMMON)
PROFILE = os.environ.get("TXQUEUE_MODEL_PROFILE", "ci")


# -- the model -------------------------------------------------------------------------


@dataclass(eq=False)
class Item:
    """An item as the model knows it."""

    pk: int
    n: int  # its payload is {"n": n}
    queue: str
    priority: int
    key: str | None
    dedup_key: str | None
    max_attempts: int
    due: bool  # run_at has come (database clock)
    # None right after a step set it from the database clock: read back at the check.
    run_at: dt.datetime | None
    round: int = 0
    status: int = READY
    attempts: int = 0
    claim: int | None = None  # the claim (a serial of ours) holding it
    lease_expired: bool = False
    old: bool = False  # finished before the last passing of time
    cancel_requested: bool = False  # asked to stop while running

    @property
    def unfinished(self) -> bool:
        return self.status in (READY, IN_PROGRESS)

    @property
    def stuck(self) -> bool:
        # No Consumer rows here: only an expired lease makes an item stuck.
        return self.status == IN_PROGRESS and self.lease_expired

    def timely(self) -> bool:
        """Whether the passing of time would change it."""
        if self.status == READY:
            return not self.due
        if self.status == IN_PROGRESS:
            return not self.lease_expired
        return not self.old

    def by_pk(self) -> int:
        return self.pk

    def claim_order(self) -> tuple:
        return (self.round, self.priority, self.run_at, self.pk)

    def claimed(self, serial: int) -> None:
        self.status, self.claim, self.lease_expired = IN_PROGRESS, serial, False
        self.attempts += 1

    def ready_again(self, *, due: bool = True, run_at_changes: bool = False) -> None:
        """READY again; an item asked to stop ends CANCELLED instead (README, "Cancelling
        items"), but for the admin's requeue, which drops the request (``requeued``)."""
        if run_at_changes:
            self.run_at = None
        if self.cancel_requested:
            self.finished(CANCELLED)
            return
        self.status, self.claim, self.lease_expired, self.due = READY, None, False, due

    def finished(self, status: int) -> None:
        """Settled in ``status``; an item asked to stop settles CANCELLED, however."""
        if self.cancel_requested:
            status = CANCELLED
        self.status, self.claim, self.lease_expired, self.old = status, None, False, False

    def requeued(self) -> None:
        """The admin's requeue: READY and due now, any cancellation request dropped."""
        self.cancel_requested = False
        self.ready_again(run_at_changes=True)
        self.old = False

    def cancel(self) -> bool:
        """READY: CANCELLED at once. Running and not asked yet: asked. Else nothing."""
        if self.status == READY:
            self.finished(CANCELLED)
            return True
        if self.status == IN_PROGRESS and not self.cancel_requested:
            self.cancel_requested = True
            return True
        return False


class Model:
    """The queue as docs/claims.md, queues.md, producing.md and the README describe it."""

    def __init__(self) -> None:
        self.items: dict[int, Item] = {}
        self.paused: set[str] = set()  # no claim takes a paused queue's items

    def of(self, queue: str) -> list[Item]:
        return [item for item in self.items.values() if item.queue == queue]

    def unfinished(self, queue: str) -> int:
        return sum(item.unfinished for item in self.of(queue))

    def twin(self, queue: str, dedup_key: str | None) -> Item | None:
        """The unfinished item holding ``dedup_key`` in ``queue``."""
        if dedup_key is None:
            return None
        held = [i for i in self.of(queue) if i.unfinished and i.dedup_key == dedup_key]
        assert len(held) <= 1
        return held[0] if held else None

    def next_round(self, queue: str, key: str | None) -> int:
        """A fair queue's next round for ``key``: after the last round served (the highest
        of an item that left READY), or after the key's newest waiting item's."""
        items = self.of(queue)
        served = max((i.round for i in items if i.status in SERVED), default=0)
        waiting = max((i.round for i in items if i.key == key and i.status == READY), default=0)
        return max(served, waiting) + 1

    def claimable(self, queue: str) -> list[Item]:
        """The due READY items a claim may take, in claim order: round (fair queues),
        priority, run_at, id. In a queue with a limit per key, an item only while its
        key's running items and its waiting ones before it number fewer than the limit."""
        items = self.of(queue)
        limit = QUEUES[queue].per_key

        def allowed(item: Item) -> bool:
            if limit is None or item.key is None:
                return True
            same = [other for other in items if other.key == item.key]
            ahead = sum(other.status == READY and other.pk < item.pk for other in same)
            running = sum(other.status == IN_PROGRESS for other in same)
            return running + ahead < limit

        if queue in self.paused:
            return []
        ready = [item for item in items if item.status == READY and item.due and allowed(item)]
        return sorted(ready, key=Item.claim_order)

    def claim(self, queue: str, limit: int, serial: int) -> list[Item]:
        taken = self.claimable(queue)[:limit]
        for item in taken:
            item.claimed(serial)
        return taken

    def holds(self, pk: int, serial: int) -> Item | None:
        """The item if claim ``serial`` still holds it (fencing), else None."""
        item = self.items.get(pk)
        if item is not None and item.status == IN_PROGRESS and item.claim == serial:
            return item
        return None

    def counts(self, queue: str) -> dict[str, int]:
        items = self.of(queue)
        return {
            "ready": sum(i.status == READY for i in items),
            "in_progress": sum(i.status == IN_PROGRESS for i in items),
            "done": sum(i.status == DONE for i in items),
            "failed": sum(i.status == FAILED for i in items),
            "cancelled": sum(i.status == CANCELLED for i in items),
            "stuck": sum(i.stuck for i in items),
        }


# -- the machine -----------------------------------------------------------------------


class Tally:
    """Steps and sequences run, and how often each kind of step and outcome came up."""

    steps = 0
    sequences = 0
    outcomes: Counter[str] = Counter()


def note(outcome: str) -> None:
    Tally.outcomes[outcome] += 1


class Refused(Exception):
    """Raised in a dequeue() block to roll it back."""


def flag(condition: Q):
    """A boolean column: whether ``condition`` holds for the row (database clock)."""
    return Case(
        When(condition, then=Value(True)), default=Value(False), output_field=BooleanField()
    )


class QueueMachine(RuleBasedStateMachine):
    """Random steps on a few queues, each checked against the model."""

    def __init__(self) -> None:
        super().__init__()
        # Each sequence starts from empty tables (the test's transactional_db empties them
        # once more at its end).
        QueueItem.objects.all().delete()
        QueueBound.objects.all().delete()
        QueuePause.objects.all().delete()
        Tally.sequences += 1
        self.model = Model()
        self.queues = list(QUEUES)
        self.pace = "even"
        # The queues the last step acted on: their reads are checked after it (every
        # row of every queue is, after every step).
        self.touched: set[str] = set()
        self.queue_objects: dict[str, Queue] = {}
        # Every claimed item, live or stale, with the claim (our serial) it came from and
        # the claim's token as the claim gave it (a settled item forgets its own).
        self.handles: list[tuple[QueueItem, int, int]] = []
        self.payloads = itertools.count()
        self.claims = itertools.count(1)
        self.last_pk = QueueItem.objects.order_by("-pk").values_list("pk", flat=True).first() or 0
        # A bounded queue stays within MAX_SIZE, unless the admin's requeue (which the bound
        # does not apply to) took it over; then within what the requeue left.
        self.allowance = {name: shape.max_size for name, shape in QUEUES.items()}

    def queue(self, name: str) -> Queue:
        """One Queue object per name for the whole sequence, as a consumer keeps it (its
        compiled claims are reused)."""
        if name not in self.queue_objects:
            self.queue_objects[name] = Queue(name)
        return self.queue_objects[name]

    def draw_queue(self, data) -> str:
        name = data.draw(st.sampled_from(self.queues), label="queue")
        self.touched.add(name)
        return name

    def live_handles(self) -> list[tuple[QueueItem, int, int]]:
        """The claimed items whose claim still holds them."""
        return [h for h in self.handles if self.model.holds(h[0].pk, h[1])]

    def taken_over_handles(self) -> list[tuple[QueueItem, int, int]]:
        """The claimed items that know of no settlement of their own, but were rescued and
        claimed again: only the fence in the database (the claim's token) refuses them."""
        return [
            h
            for h in self.handles
            if h[0].status == IN_PROGRESS
            and h[0].pk in self.model.items
            and self.model.items[h[0].pk].status == IN_PROGRESS
            and not self.model.holds(h[0].pk, h[1])
        ]

    @initialize(
        names=st.lists(st.sampled_from(list(QUEUES)), min_size=1, max_size=3, unique=True),
        pace=st.sampled_from(["even", "producers ahead", "consumers ahead"]),
    )
    def begin(self, names, pace):
        """A few queues per sequence, so that steps meet on the same items; and who leads,
        so that queues fill up (MAX_SIZE, long rounds) in some sequences and run dry in
        others."""
        self.queues = names
        self.touched = set(names)
        self.pace = pace

    # -- the one rule: a step, weighted ------------------------------------------------

    def actions(self) -> list[str]:
        """The steps possible now, each as often as it should come up.

        Chosen here rather than as one Hypothesis rule each: Hypothesis turns a random
        part of the rules off in each sequence, and a consumer's whole cycle (claim, lease
        lost, rescue, claim again, an acknowledgement of the stale claim) then rarely fit
        in the few hundred steps a run of the suite can afford."""
        items = self.model.items.values()
        produce = {"even": 3, "producers ahead": 6, "consumers ahead": 1}[self.pace]
        steps = ["enqueue"] * produce + ["enqueue_many"] * max(produce // 2, 1)
        if items:
            steps += ["claim"] * 3 + ["dequeue", "requeue", "mark failed", "cancel"]
        if self.handles:  # live claims settle more often than stale ones
            steps += ["ack_and_claim"] + ["settle"] * (4 if self.live_handles() else 1)
        if any(i.timely() for i in items):
            steps += ["time passes"]
        if any(i.status == IN_PROGRESS and not i.lease_expired for i in items):
            steps += ["a lease runs out"] * 2
        if any(i.stuck for i in items):
            steps += ["rescue"] * 3
        if any(i.old for i in items):
            steps += ["purge"]
        steps += ["pause"] + ["resume"] * (3 if self.model.paused else 0)
        return steps

    @rule(data=st.data())
    def step(self, data):
        action = data.draw(st.sampled_from(self.actions()), label="step")
        Tally.steps += 1
        note(f"step: {action}")
        getattr(self, action.replace(" ", "_") + "_step")(data)

    def enqueue_step(self, data):
        self.enqueue(self.draw_queue(data), data.draw(OPTIONS, label="options"))

    def enqueue_many_step(self, data):
        name, options = self.draw_queue(data), data.draw(OPTIONS, label="options")
        self.enqueue_many(name, options, data.draw(st.integers(0, 4), label="size"))

    def claim_step(self, data, acks=None):
        if acks and data.draw(st.integers(0, 3), label="another queue if 0"):
            name = acks["queue"]  # a consumer's loop: the claim's own queue
            self.touched.add(name)
        else:
            name = self.draw_queue(data)
        limit = data.draw(st.integers(1, 4), label="limit")
        strategy = data.draw(st.sampled_from(["auto", *strategies()]), label="strategy")
        self.claim(name, limit, strategy, acks)

    def ack_and_claim_step(self, data):
        self.claim_step(data, acks=self.draw_acks(data))

    def dequeue_step(self, data):
        self.dequeue(self.draw_queue(data), data.draw(st.booleans(), label="rolls back"))

    def settle_step(self, data):
        how = data.draw(st.sampled_from(SETTLEMENTS), label="settlement")
        live, taken_over = self.live_handles(), self.taken_over_handles()
        stale = not live or data.draw(st.integers(0, 3), label="a stale claim if 0") == 0
        pool = (taken_over or self.handles) if stale else live
        self.settle(how, *data.draw(st.sampled_from(pool), label="claimed"))

    def time_passes_step(self, data):
        self.time_passes()

    def a_lease_runs_out_step(self, data):
        items = self.model.items.values()
        running = [i for i in items if i.status == IN_PROGRESS and not i.lease_expired]
        self.lease_runs_out(data.draw(st.sampled_from(sorted(running, key=Item.by_pk))))

    def rescue_step(self, data):
        how = data.draw(st.sampled_from(RESCUES), label="rescue")
        stuck = sorted({item.queue for item in self.model.items.values() if item.stuck})
        name = data.draw(st.sampled_from(stuck), label="queue")
        self.touched.add(name)
        self.rescue(name, how)

    def requeue_step(self, data):
        name = self.draw_queue(data)
        self.requeue(name, *self.draw_selection(data, name))

    def mark_failed_step(self, data):
        name = self.draw_queue(data)
        self.mark_failed(*self.draw_selection(data, name))

    def purge_step(self, data):
        self.purge(self.draw_queue(data))

    def pause_step(self, data):
        name = self.draw_queue(data)
        assert self.queue(name).pause() is (name not in self.model.paused)
        self.model.paused.add(name)

    def resume_step(self, data):
        name = data.draw(st.sampled_from(sorted(self.model.paused)), label="queue")
        self.touched.add(name)
        assert self.queue(name).resume() is True
        self.model.paused.discard(name)

    def cancel_step(self, data):
        how = data.draw(st.sampled_from(CANCELS), label="cancel")
        if how == "Queue.cancel" or not self.handles:
            name = self.draw_queue(data)
            self.cancel_many(name, *self.draw_selection(data, name))
        elif how == "QueueItem.cancel":
            items = sorted(self.model.items.values(), key=Item.by_pk)
            self.cancel_one(data.draw(st.sampled_from(items), label="item"))
        else:  # on a claimed item: the handler's own instance, its claim live or stale
            live = self.live_handles()
            stale = not live or data.draw(st.integers(0, 3), label="a stale claim if 0") == 0
            pool = self.handles if stale else live
            handle, _, _ = data.draw(st.sampled_from(pool), label="claimed")
            self.cancel_claimed(handle)

    # -- producing -------------------------------------------------------------------

    def schedule(self, schedule: str) -> tuple[dict, bool, dt.datetime | None]:
        """enqueue's arguments for ``schedule``, whether the item is due at once, and its
        run_at when the test gives it."""
        now = timezone.now()
        if schedule == "past":
            return {"run_at": now - HOUR}, True, now - HOUR
        if schedule == "later":
            return {"run_at": now + HOUR}, False, now + HOUR
        if schedule == "delay":
            return {"delay": HOUR}, False, None
        return {}, True, None

    def new_item(self, pk, n, queue, options, due, run_at, round_) -> None:
        assert pk > self.last_pk, "ids grow: a new item's id is above every earlier one"
        self.last_pk = pk
        self.model.items[pk] = Item(
            pk=pk,
            n=n,
            queue=queue,
            priority=options["priority"],
            key=options["key"],
            dedup_key=options["dedup_key"],
            max_attempts=options["max_attempts"] or DEFAULT_MAX_ATTEMPTS,
            due=due,
            run_at=run_at,
            round=round_,
        )

    def enqueue(self, name, options):
        """A new item; or the unfinished item holding its dedup key, nothing written; or
        QueueFull past MAX_SIZE, nothing written; or ValueError without a key where the
        queue needs one, nothing written."""
        shape = QUEUES[name]
        timing, due, run_at = self.schedule(options["schedule"])
        kwargs = {k: options[k] for k in ("priority", "key", "dedup_key", "max_attempts")}
        n = next(self.payloads)
        twin = self.model.twin(name, options["dedup_key"])
        unfinished = self.model.unfinished(name)

        if shape.needs_key and options["key"] is None:
            with pytest.raises(ValueError, match="each item needs a key"):
                enqueue(name, {"n": n}, **kwargs, **timing)
            return
        if twin is None and shape.max_size is not None and unfinished + 1 > shape.max_size:
            with pytest.raises(QueueFull) as refused:
                enqueue(name, {"n": n}, **kwargs, **timing)
            assert refused.value.current_size == unfinished
            assert refused.value.item.pk is None
            note("enqueue: QueueFull")
            return
        round_ = self.model.next_round(name, options["key"]) if shape.fair else 0
        item = enqueue(name, {"n": n}, **kwargs, **timing)
        if twin is not None:
            assert item.pk == twin.pk, "a held dedup key returns its unfinished item"
            note("enqueue: dedup key held")
            return
        self.new_item(item.pk, n, name, options, due, run_at, round_)

    def enqueue_many(self, name, options, size):
        """``size`` new items in the order given, all or none (MAX_SIZE)."""
        shape = QUEUES[name]
        timing, due, run_at = self.schedule(options["schedule"])
        kwargs = {k: options[k] for k in ("priority", "key", "dedup_key", "max_attempts")}
        ns = [next(self.payloads) for _ in range(size)]
        payloads = [{"n": n} for n in ns]
        unfinished = self.model.unfinished(name)

        if options["dedup_key"] is not None:
            with pytest.raises(ValueError, match="dedup_key names one item"):
                enqueue_many(name, payloads, **kwargs, **timing)
            return
        if shape.needs_key and options["key"] is None:
            with pytest.raises(ValueError, match="each item needs a key"):
                enqueue_many(name, payloads, **kwargs, **timing)
            return
        if size and shape.max_size is not None and unfinished + size > shape.max_size:
            with pytest.raises(QueueFull) as refused:
                enqueue_many(name, payloads, **kwargs, **timing)
            assert refused.value.current_size == unfinished
            note("enqueue_many: QueueFull")
            return
        first_round = self.model.next_round(name, options["key"]) if shape.fair else 0
        items = enqueue_many(name, payloads, **kwargs, **timing)
        assert [item.payload for item in items] == payloads
        pks = [item.pk for item in items]
        if None in pks:  # MySQL/MariaDB cannot return the ids of a multi-row INSERT
            rows = self.queue(name).items.filter(pk__gt=self.last_pk).order_by("pk")
            found = list(rows.values_list("pk", "payload"))
            assert [payload for _, payload in found] == payloads, "ids follow the batch's order"
            pks = [pk for pk, _ in found]
        for offset, (pk, n) in enumerate(zip(pks, ns, strict=True)):
            round_ = first_round + offset if shape.fair else 0
            self.new_item(pk, n, name, options, due, run_at, round_)

    # -- consuming -------------------------------------------------------------------

    def draw_acks(self, data) -> dict:
        """Some items of one claim to acknowledge: mostly a live claim, as a consumer's;
        now and then a stale one."""
        live = self.live_handles()
        stale = not live or data.draw(st.integers(0, 3), label="a stale claim if 0") == 0
        handle, serial, token = data.draw(
            st.sampled_from(self.handles if stale else live), label="claim acked"
        )
        mine = [h for h, s, _ in self.handles if s == serial]
        acked = data.draw(st.lists(st.sampled_from(mine), min_size=1, unique=True))
        return {"serial": serial, "token": token, "handles": acked, "queue": handle.queue}

    def claim(self, name, limit, strategy, acks):
        """Queue.claim; with ``acks``, Queue.claims.ack_and_claim, the consumer's loop, which
        acknowledges the items of one claim (only those it still holds), then claims."""
        acked = 0
        if acks:
            for handle in acks["handles"]:
                self.touched.add(handle.queue)
                item = self.model.holds(handle.pk, acks["serial"])
                if item is not None:
                    item.finished(DONE)
                    acked += 1
        serial = next(self.claims)
        expected = self.model.claim(name, limit, serial)
        if acks:
            results = {handle.pk: {"n": handle.payload["n"]} for handle in acks["handles"]}
            count, claimed = self.queue(name).claims.ack_and_claim(
                Ack(acks["token"], results), limit, pid="model", strategy=strategy
            )
            assert count == acked, "only the items the claim still holds are acknowledged"
        else:
            claimed = self.queue(name).claim(limit, pid="model", strategy=strategy)
        assert [item.pk for item in claimed] == [item.pk for item in expected]
        note(f"claim: {len(claimed)} of {limit}")
        for item in claimed:
            assert item.status == IN_PROGRESS
            assert item.attempts == self.model.items[item.pk].attempts
        self.handles += [(item, serial, item.claim_token) for item in claimed]

    def dequeue(self, name, rolls_back):
        """The next item, DONE when the block ends; nothing changed when it raises."""
        expected = self.model.claimable(name)[:1]
        try:
            with self.queue(name).dequeue() as item:
                assert (item and item.pk) == (expected[0].pk if expected else None)
                if rolls_back:
                    raise Refused
        except Refused:
            return  # rolled back: nothing changed, not even the attempt
        if expected:
            expected[0].attempts += 1
            expected[0].finished(DONE)

    def settle(self, how, handle, serial, token):
        """An acknowledgement through a claimed item: it changes the row only while that
        claim still holds it; an expired lease alone does not fence."""
        self.touched.add(handle.queue)
        item = self.model.holds(handle.pk, serial)
        taken_over = item is None and (handle, serial, token) in self.taken_over_handles()
        if item is not None and item.cancel_requested:
            note(f"settle: {how} after a cancellation request")
        if how == "ack":
            changed = handle.ack({"n": handle.payload["n"]})
            if item:
                item.finished(DONE)
        elif how.startswith("retry"):
            delay = {"retry": 0, "retry later": HOUR, "retry backoff": None}[how]
            changed = handle.retry("model", delay=delay)
            if item and item.attempts >= item.max_attempts:
                item.finished(FAILED)  # attempts spent
            elif item:
                item.ready_again(due=delay == 0, run_at_changes=True)
        elif how == "fail":
            changed = handle.fail("model")
            if item:
                item.finished(FAILED)
        else:
            changed = handle.release()
            if item:
                item.attempts -= 1  # a release does not count the attempt
                item.ready_again()
        assert changed == (item is not None), "fenced: only the claim holding the item settles"
        note(f"settle: {how} {'applied' if changed else 'refused'}")
        if taken_over:
            note("settle: refused, the item claimed again since")

    # -- time --------------------------------------------------------------------------

    def lease_runs_out(self, item):
        self.touched.add(item.queue)
        expire(item)
        item.lease_expired = True

    def time_passes(self):
        """ELAPSED goes by: every time in the table moves that much into the past."""
        moved = {
            field: F(field) - ELAPSED
            for field in ("run_at", "lease_expires_at", "claimed_at", "created_at", "finished_at")
        }
        QueueItem.objects.update(**moved)
        self.touched.update(self.queues)
        for item in self.model.items.values():
            if item.run_at is not None:
                item.run_at -= ELAPSED
            item.due = True
            item.lease_expired = item.status == IN_PROGRESS
            item.old = item.status in FINISHED

    # -- maintaining -------------------------------------------------------------------

    def rescue(self, name, how):
        """Stuck items go back READY (their place in the queue kept), or FAILED when their
        attempts are spent: Queue.requeue_stuck, txqueue_requeue_stuck for one queue or
        for every queue."""
        everywhere = how == "command all"
        scope = list(self.model.items.values()) if everywhere else self.model.of(name)
        if everywhere:
            self.touched.update(self.queues)
        stuck = [item for item in scope if item.stuck]
        for item in stuck:
            if item.attempts >= item.max_attempts:
                item.finished(FAILED)
            else:
                item.ready_again()
        note(f"rescue: {how}")
        if how == "Queue.requeue_stuck":
            assert self.queue(name).requeue_stuck() == len(stuck)
        else:
            out = io.StringIO()
            call_command("txqueue_requeue_stuck", *([] if everywhere else [name]), stdout=out)
            noun = "item" if len(stuck) == 1 else "items"
            assert out.getvalue().strip() == f"Rescued {len(stuck)} stuck {noun}."

    def draw_selection(self, data, name) -> tuple[list[Item], object]:
        """Some items of queue ``name`` (now and then all of them) and the queryset naming
        them, as the admin's changelist selects them."""
        items = sorted(self.model.of(name), key=Item.by_pk)
        if not items or data.draw(st.integers(0, 3), label="whole queue if 0") == 0:
            return items, self.queue(name).items
        chosen = data.draw(st.lists(st.sampled_from(items), min_size=1, unique=True))
        return chosen, self.queue(name).items.filter(pk__in=[item.pk for item in chosen])

    def requeue(self, name, chosen, selection):
        """The admin's requeue: READY and due now, attempts kept, for READY, FAILED and
        stuck items; a FAILED item whose dedup key an unfinished item holds stays FAILED.
        DONE and running items stay as they are."""
        keyed = [i for i in chosen if i.status == FAILED and i.dedup_key is not None]
        plain = [i for i in chosen if i.status == READY or i.stuck]
        plain += [i for i in chosen if i.status == FAILED and i.dedup_key is None]
        for item in plain:
            item.requeued()
        changed = selection.requeue()
        # Of the FAILED items that share a free dedup key, one goes back: which one is the
        # database's choice, read back.
        won = 0
        for dedup_key in sorted({item.dedup_key for item in keyed}):
            group = [item for item in keyed if item.dedup_key == dedup_key]
            back = [i for i in group if QueueItem.objects.filter(pk=i.pk, status=READY).exists()]
            if self.model.twin(name, dedup_key) is not None:
                assert back == [], "a held dedup key keeps its FAILED items FAILED"
                continue
            assert len(back) == 1, "one FAILED item takes back a free dedup key"
            back[0].requeued()
            won += 1
        assert changed == len(plain) + won
        note(f"requeue: {'some' if changed else 'none'} changed")
        shape = QUEUES[name]
        if shape.max_size is not None:
            self.allowance[name] = max(shape.max_size, self.model.unfinished(name))

    def mark_failed(self, chosen, selection):
        """The admin's mark failed: READY and stuck items become FAILED; running and
        finished ones stay as they are."""
        failing = [item for item in chosen if item.status == READY or item.stuck]
        for item in failing:
            item.cancel_requested = False  # the admin's verdict stands: FAILED
            item.finished(FAILED)
        assert selection.mark_failed("model") == len(failing)

    def cancel_many(self, name, chosen, selection):
        """Queue.cancel: of everything unfinished (None), or of a selection, in one UPDATE;
        then the handlers of the live claims learn of the requests with their consumer's
        lease renewal."""
        expected = sum(item.cancel() for item in chosen)
        whole = len(chosen) == len(self.model.of(name))
        changed = self.queue(name).cancel(None if whole else selection)
        assert changed == expected, "READY items end, running ones are asked, once"
        note(f"cancel: Queue.cancel {'all' if whole else 'some'}, {changed} changed")
        self.check_requests_reach_the_handlers()

    def cancel_one(self, item):
        """QueueItem.cancel through a fresh copy of the row, as another process would."""
        self.touched.add(item.queue)
        expected = item.cancel()
        assert QueueItem.objects.get(pk=item.pk).cancel() == expected
        note(f"cancel: QueueItem.cancel {'changed' if expected else 'nothing'}")
        self.check_requests_reach_the_handlers()

    def cancel_claimed(self, handle):
        """QueueItem.cancel on a handler's own instance: the item, whatever claim holds it
        now (a stale claim's instance cancels the row as it is); a live claim's instance
        knows of the request at once, with no query."""
        self.touched.add(handle.queue)
        item = self.model.items.get(handle.pk)  # None: purged
        expected = item is not None and item.cancel()
        assert handle.cancel() == expected
        live = any(h is handle for h, _, _ in self.live_handles())
        if live:
            assert handle.cancel_requested()
        note(f"cancel: a handler's own item, {'live' if live else 'stale'}")
        self.check_requests_reach_the_handlers()

    def check_requests_reach_the_handlers(self):
        """One read with the lease renewal tells each live claim's instance whether it was
        asked to stop (``cancel_requested()``, itself no query)."""
        live = self.live_handles()
        housekeeping(
            *self.queues, held=lambda: [(handle, None) for handle, _, _ in live]
        )._read_cancel_requests()
        for handle, serial, _ in live:
            item = self.model.holds(handle.pk, serial)
            assert item is not None
            assert handle.cancel_requested() == item.cancel_requested, f"item {handle.pk}"

    def purge(self, name):
        """DONE, FAILED and CANCELLED items finished before the last passing of time are
        deleted."""
        old = [item for item in self.model.of(name) if item.status in FINISHED and item.old]
        for item in old:
            del self.model.items[item.pk]
        assert self.queue(name).purge(older_than=OLD) == len(old)

    # -- checks after every step -------------------------------------------------------

    @invariant()
    def database_matches_model(self):
        """Row for row, then the rules that hold whatever the model says, then the reads."""
        rows = self.read_rows()
        self.compare_rows(rows)
        self.check_rules(rows)
        for name in sorted(self.touched):
            self.check_reads(name)
        self.touched.clear()

    def read_rows(self) -> dict[int, dict]:
        rows = QueueItem.objects.values(
            "pk",
            "queue",
            "payload",
            "status",
            "attempts",
            "priority",
            "key",
            "dedup_key",
            "max_attempts",
            "round",
            "run_at",
            "claim_token",
            due=flag(Q(run_at__lte=Now())),
            lease_expired=flag(Q(lease_expires_at__lt=Now())),
            old=flag(Q(finished_at__lt=Now() - OLD)),
        )
        return {row["pk"]: row for row in rows}

    def compare_rows(self, rows):
        assert sorted(rows) == sorted(self.model.items), "the same items, no more, no fewer"
        for pk, item in self.model.items.items():
            row = rows[pk]
            expected = {
                "queue": item.queue,
                "payload": {"n": item.n},
                "status": item.status,
                "attempts": item.attempts,
                "priority": item.priority,
                "key": item.key,
                "dedup_key": item.dedup_key,
                "max_attempts": item.max_attempts,
                "round": item.round,
            }
            assert {name: row[name] for name in expected} == expected, f"item {pk}"
            if item.status == READY:
                assert bool(row["due"]) == item.due, f"item {pk} due: {row['run_at']}"
            if item.status == IN_PROGRESS:
                assert bool(row["lease_expired"]) == item.lease_expired, f"item {pk} lease"
            if item.status in FINISHED:
                assert bool(row["old"]) == item.old, f"item {pk} finished long ago"
            if item.run_at is None:
                item.run_at = row["run_at"]  # set by the database clock in this step
            assert row["run_at"] == item.run_at, f"item {pk} run_at"

    def check_rules(self, rows):
        """What holds of the rows themselves, whatever the model says."""
        unfinished = [row for row in rows.values() if row["status"] in (READY, IN_PROGRESS)]
        held = Counter((r["queue"], r["dedup_key"]) for r in unfinished if r["dedup_key"])
        assert all(n == 1 for n in held.values()), f"one unfinished item per dedup key: {held}"
        for name, shape in QUEUES.items():
            mine = [row for row in unfinished if row["queue"] == name]
            if shape.per_key is not None:
                running = Counter(row["key"] for row in mine if row["status"] == IN_PROGRESS)
                assert all(n <= shape.per_key for n in running.values()), f"{name}: {running}"
            if shape.max_size is not None:
                if len(mine) <= shape.max_size:
                    self.allowance[name] = shape.max_size
                assert len(mine) <= self.allowance[name], f"{name} over MAX_SIZE"
        # Every claim has its own fencing token, shared by the items it took.
        tokens: dict[int, set] = {}
        for item in self.model.items.values():
            if item.status == IN_PROGRESS:
                tokens.setdefault(item.claim, set()).add(rows[item.pk]["claim_token"])
        assert all(len(t) == 1 and None not in t for t in tokens.values()), tokens
        assert len(set().union(*tokens.values())) == len(tokens), "a token per claim"

    def check_reads(self, name):
        """count(), stats() and peek() of a queue the step acted on."""
        queue = self.queue(name)
        counts = self.model.counts(name)
        before_stats = timezone.now()
        stats = queue.stats()
        after_stats = timezone.now()
        assert {key: stats[key] for key in counts} == counts, name
        assert queue.count() == counts["ready"]
        assert queue.count(status=None) == len(self.model.of(name))
        assert stats["paused"] is queue.is_paused() is (name in self.model.paused)
        due = [i for i in self.model.of(name) if i.status == READY and i.due]
        if not due:
            assert stats["oldest_ready_age_s"] == 0.0
        else:
            oldest = min(item.run_at for item in due)
            # The database's clock is this host's; a second of slack for rounding.
            low = (before_stats - oldest).total_seconds() - 1
            high = (after_stats - oldest).total_seconds() + 1
            assert low <= stats["oldest_ready_age_s"] <= high, (name, stats, oldest)
        if QUEUES[name].needs_key:
            waiting = Counter(i.key for i in self.model.of(name) if i.status == READY)
            top = sorted(waiting.items(), key=lambda pair: (-pair[1], pair[0]))[:10]
            assert stats["keys_waiting"] == len(waiting)
            assert stats["top_keys"] == [[key, n] for key, n in top]
        head = self.model.claimable(name)[:1]
        peeked = queue.peek()
        assert (peeked and peeked.pk) == (head[0].pk if head else None), "peek: the next claim"


@pytest.mark.django_db(transaction=True)
def test_the_queue_behaves_as_its_model(record_property):
    Tally.steps = Tally.sequences = 0
    Tally.outcomes.clear()
    run_state_machine_as_test(
        QueueMachine, settings=settings.get_profile(f"txqueue-model-{PROFILE}")
    )
    record_property("model_steps", Tally.steps)
    print(
        f"\nmodel-based test ({PROFILE} profile) on {connection.display_name}: "
        f"{Tally.steps} steps in {Tally.sequences} sequences"
    )
    for outcome, times in sorted(Tally.outcomes.items()):
        print(f"  {outcome}: {times}")
