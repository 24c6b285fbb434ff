"""consumer/rotation.py: which queue a consumer claims from next. Queues in turn, so that a busy
one cannot starve the others; idle ones passed over until woken or POLL_INTERVAL later;
the orphaned on_commit calls at start, when the others are idle and at least every
POLL_INTERVAL; queues found as they come. Then a consumer of 50 queues on a real
database, its claims counted."""

import time
from collections import Counter

import pytest

from django_txqueue import Queue, Status
from django_txqueue.consumer.claims import Claimer
from django_txqueue.consumer.rotation import Rotation
from django_txqueue.consumer.worker import Worker
from django_txqueue.outbox import QUEUE as OUTBOX
from tests.helpers import running, wait_for


def noop(item):
    return None


class Claims:
    """Stands for the consumer's claim of one queue: gives ``items[name]`` once, records
    the names tried."""

    def __init__(self, **items):
        self.items = {name.replace("_", "-"): n for name, n in items.items()}
        self.tried = []

    def __call__(self, name):
        self.tried.append(name)
        return [name] * self.items.pop(name, 0)


def rotation(*names, **options):
    return Rotation(dict.fromkeys(names, noop), "default", **options)


def test_the_queues_take_turns_after_the_one_that_last_gave(settings):
    settings.TXQUEUE = {**settings.TXQUEUE, "POLL_INTERVAL": 60}
    turns = rotation("a", "b", "c")
    claims = Claims(a=1, b=1, c=1)
    assert turns.first_to_give(claims) == ["a"]  # the outbox first, at start: empty
    claims.items.update({"a": 1})
    assert turns.first_to_give(claims) == ["b"]  # not "a" again, though it has more
    assert turns.first_to_give(claims) == ["c"]
    assert turns.first_to_give(claims) == ["a"]
    assert claims.tried == [OUTBOX, "a", "b", "c", "a"]


def test_the_outbox_is_tried_at_start_then_only_when_idle_or_due(settings):
    settings.TXQUEUE = {**settings.TXQUEUE, "POLL_INTERVAL": 0.2}
    turns = rotation("busy")
    claims = Claims(busy=100)
    turns.first_to_give(claims)  # at start: the outbox first
    claims.items["busy"] = 1
    turns.first_to_give(claims)  # busy: not the outbox again
    assert claims.tried == [OUTBOX, "busy", "busy"]
    turns.first_to_give(claims)  # idle: the outbox after the others
    assert claims.tried[-2:] == ["busy", OUTBOX]
    time.sleep(0.25)
    claims.items["busy"] = 1
    turns.first_to_give(claims)  # POLL_INTERVAL passed: the outbox first, though busy
    assert claims.tried[-2:] == [OUTBOX, "busy"]


def test_producers_wake_it_for_its_queues_but_not_for_on_commit_calls():
    turns = rotation("a", "b")
    assert turns.woken_for() == ["a", "b"]
    assert OUTBOX in turns.queues and OUTBOX in turns.handlers


def test_new_queues_are_found_when_a_look_is_due(db, monkeypatch):
    monkeypatch.setattr("django_txqueue.consumer.rotation.DISCOVERY_INTERVAL", 60)
    Queue("known").enqueue({})
    Queue("found").enqueue({})
    Queue("not-ours").enqueue({})
    turns = rotation("known", discover=lambda name: noop if name == "found" else None)
    assert turns.discover_new() == ["found"]
    assert turns.handlers["found"] is noop and turns.queues["found"].name == "found"
    Queue("later").enqueue({})
    assert turns.discover_new() == []  # the next look is a minute away
    assert "not-ours" not in turns.queues


def test_without_a_discoverer_it_never_looks(db):
    Queue("elsewhere").enqueue({})
    assert rotation("a").discover_new() == []


class TestIdleQueues:
    """A queue whose claim came back empty is passed over until woken."""

    def fifty(self, settings, poll=60):
        settings.TXQUEUE = {**settings.TXQUEUE, "POLL_INTERVAL": poll}
        return rotation(*(f"q{n}" for n in range(50)))

    def test_an_idle_queue_costs_no_claim_until_woken(self, settings):
        turns = self.fifty(settings)
        claims = Claims(q7=3)
        assert turns.first_to_give(claims) == ["q7"] * 3
        assert claims.tried == [OUTBOX, *(f"q{n}" for n in range(8))]
        claims.tried.clear()
        claims.items["q7"] = 1
        assert turns.first_to_give(claims) == ["q7"]
        assert claims.tried == [*(f"q{n}" for n in range(8, 50)), "q7"]
        claims.tried.clear()
        for _ in range(3):
            assert turns.first_to_give(claims) == []
        # q7 once more (empty), then only the outbox, tried whenever the others give
        # nothing (its own rule): no claim of the 50 idle queues.
        assert claims.tried == ["q7", OUTBOX, OUTBOX, OUTBOX]
        assert turns.passed_over
        turns.wake({"q3", "elsewhere"})  # a name it does not serve changes nothing
        claims.items["q3"] = 2
        claims.tried.clear()
        assert turns.first_to_give(claims) == ["q3", "q3"]
        assert claims.tried == ["q3"]

    def test_waking_every_queue_claims_from_each_once(self, settings):
        turns = self.fifty(settings)
        turns.first_to_give(Claims())
        claims = Claims()
        turns.first_to_give(claims)
        assert claims.tried == [OUTBOX] and turns.passed_over
        turns.wake(None)
        claims.tried.clear()
        assert turns.first_to_give(claims) == []
        assert claims.tried == [*(f"q{n}" for n in range(50)), OUTBOX]
        assert not turns.passed_over

    def test_an_idle_queue_is_claimed_again_after_poll_interval(self, settings):
        turns = self.fifty(settings, poll=0.2)
        turns.first_to_give(Claims())  # all idle
        turns.wake({"q0"})
        claims = Backlog(q0=100)
        for _ in range(3):
            turns.first_to_give(claims)
        assert claims.tried == ["q0"] * 3  # the others idle
        time.sleep(0.25)
        claims.tried.clear()
        claims.items["q9"] = 1
        assert turns.first_to_give(claims) == ["q9"]  # due again, in its turn after q0
        assert claims.tried == [OUTBOX, *(f"q{n}" for n in range(1, 10))]

    def test_queues_with_work_take_turns_among_idle_ones(self, settings):
        turns = self.fifty(settings)
        claims = Backlog(q3=100, q40=100)
        given = [turns.first_to_give(claims)[0] for _ in range(6)]
        assert given == ["q3", "q40"] * 3
        claims.tried.clear()
        turns.first_to_give(claims), turns.first_to_give(claims)
        assert claims.tried == ["q3", "q40"]  # no round trip to the 48 idle ones

    def test_the_outbox_keeps_its_own_rule(self, settings):
        settings.TXQUEUE = {**settings.TXQUEUE, "POLL_INTERVAL": 60}
        turns = rotation("a", "b")
        claims = Claims()
        for _ in range(3):
            turns.first_to_give(claims)
        # At start; then each time the others give nothing (here: all idle).
        assert claims.tried == [OUTBOX, "a", "b", OUTBOX, OUTBOX]


class TestLookingFirst:
    """With a probe (the consumer's: one statement for many queues), queues of unknown
    state are looked at together, and only those with due items are claimed."""

    def turns(self, settings, due, poll=60):
        settings.TXQUEUE = {**settings.TXQUEUE, "POLL_INTERVAL": poll}
        self.looks = []

        def probe(names):
            self.looks.append(names)
            return set(due) & set(names)

        return rotation(*(f"q{n}" for n in range(50)), probe=probe)

    def test_at_start_only_the_queues_with_due_items_are_claimed(self, settings):
        turns = self.turns(settings, due={"q7", "q30"})
        claims = Claims(q7=1, q30=1)
        assert turns.first_to_give(claims) == ["q7"]
        assert turns.first_to_give(claims) == ["q30"]
        assert claims.tried == [OUTBOX, "q7", "q30"]
        assert self.looks == [sorted(f"q{n}" for n in range(50))]  # one look, all 50

    def test_a_pass_whose_queues_were_all_looked_at_passed_over_none(self, settings):
        # What ends a burst run: every queue claimed, or found empty, in the last pass.
        turns = self.turns(settings, due=set())
        turns.first_to_give(Claims())
        assert not turns.passed_over
        turns.first_to_give(Claims())
        assert turns.passed_over  # idle, and not looked at again
        turns.wake(None)
        claims = Claims()
        assert turns.first_to_give(claims) == []
        assert claims.tried == [OUTBOX] and not turns.passed_over
        assert len(self.looks) == 2

    def test_queues_whose_poll_interval_ran_out_are_looked_at_together(self, settings):
        turns = self.turns(settings, due={"q3"}, poll=0.2)
        turns.first_to_give(Claims(q3=1))
        time.sleep(0.25)
        claims = Claims(q3=1)
        assert turns.first_to_give(claims) == ["q3"]
        assert claims.tried == [OUTBOX, "q3"] and len(self.looks) == 2

    def test_one_queue_of_unknown_state_is_claimed_without_a_look(self, settings):
        turns = self.turns(settings, due=set())
        turns.first_to_give(Claims())  # all idle
        turns.wake({"q5"})  # named: claimed at once
        claims = Claims(q5=1)
        assert turns.first_to_give(claims) == ["q5"] and len(self.looks) == 1


class Backlog(Claims):
    """Gives one item per claim while ``items[name]`` lasts."""

    def __call__(self, name):
        self.tried.append(name)
        if self.items.get(name, 0) <= 0:
            return []
        self.items[name] -= 1
        return [name]


def noop_handler(item):
    return None


def slow_handler(item):
    time.sleep(0.005)


class ClaimLog:
    """Counts the consumer's claims (one round trip each) by queue name."""

    def __init__(self, monkeypatch):
        self.names = Counter()
        self.given = []
        claim = Claimer.claim

        def counted(claimer, name):
            items = claim(claimer, name)
            self.names[name] += 1
            if items:
                self.given.append(name)
            return items

        monkeypatch.setattr(Claimer, "claim", counted)


def fifty_queues(hot=noop_handler, **options):
    """A consumer of queues spread-0 to spread-49, ``hot`` the handler of spread-0."""
    handlers = {f"spread-{n}": noop_handler for n in range(50)}
    handlers["spread-0"] = hot
    return Worker(handlers=handlers, **options)


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("fast_consumers")
class TestManyQueues:
    def test_idle_queues_cost_no_claim_per_turn(self, settings, monkeypatch):
        settings.TXQUEUE = {**settings.TXQUEUE, "POLL_INTERVAL": 60}
        log = ClaimLog(monkeypatch)
        Queue("spread-0").enqueue_many([{"n": n} for n in range(400)])
        assert fifty_queues(batch=10, burst=True).run() == 0
        assert Queue("spread-0").count(status=Status.DONE) == 400
        assert 40 <= log.names["spread-0"] <= 45  # 40 batches, the empty ones at the end
        idle = [log.names[f"spread-{n}"] for n in range(1, 50)]
        # Looked at together, one statement each time, at start, when wake-ups start to
        # reach it (a LISTEN opened, producers learnt its address: what they sent before
        # is lost) and for the burst's last pass: never claimed (40 times each before
        # idle queues were passed over, 3 before they were looked at together).
        assert max(idle) == 0, idle

    def test_an_idle_queue_woken_by_a_producer_is_claimed_at_once(self, settings):
        settings.TXQUEUE = {**settings.TXQUEUE, "POLL_INTERVAL": 60}
        Queue("spread-0").enqueue_many([{"n": n} for n in range(2000)])
        worker = fifty_queues(hot=slow_handler, batch=10)
        with running(worker):
            assert wait_for(lambda: "spread-7" in worker.rotation.idle)
            time.sleep(0.5)  # past a new consumer's first ADDRESS_CACHE_SECONDS
            started = time.monotonic()
            Queue("spread-7").enqueue({"late": True})
            assert wait_for(lambda: Queue("spread-7").count(status=Status.DONE), timeout=5)
            took = time.monotonic() - started
            assert Queue("spread-0").count(status=Status.READY) > 0  # still busy meanwhile
        assert took < 1.5, took  # not the POLL_INTERVAL of a minute

    def test_an_idle_queue_with_work_due_unannounced_is_claimed_within_poll_interval(
        self, settings, monkeypatch
    ):
        settings.TXQUEUE = {**settings.TXQUEUE, "POLL_INTERVAL": 0.5}
        log = ClaimLog(monkeypatch)
        Queue("spread-0").enqueue_many([{"n": n} for n in range(3000)])
        # Its wake-up comes at once, while it is not due: nothing announces it later.
        Queue("spread-7").enqueue({"later": True}, delay=1)
        worker = fifty_queues(hot=slow_handler, batch=10)
        started = time.monotonic()
        with running(worker):
            assert wait_for(lambda: Queue("spread-7").count(status=Status.DONE), timeout=5)
            took = time.monotonic() - started
            assert Queue("spread-0").count(status=Status.READY) > 0  # still busy meanwhile
        # Claimed once per POLL_INTERVAL while it waited (and twice at start, as every
        # queue), not once per batch.
        assert log.names["spread-7"] <= took / 0.5 + 3, (log.names, took)

    def test_queues_with_work_share_the_consumer(self, settings, monkeypatch):
        settings.TXQUEUE = {**settings.TXQUEUE, "POLL_INTERVAL": 60}
        log = ClaimLog(monkeypatch)
        Queue("spread-3").enqueue_many([{"n": n} for n in range(100)])
        Queue("spread-30").enqueue_many([{"n": n} for n in range(100)])
        assert fifty_queues(batch=10, burst=True).run() == 0
        assert log.given[:20] == ["spread-3", "spread-30"] * 10

    def test_a_burst_ends_only_after_claiming_from_every_queue(self, settings):
        settings.TXQUEUE = {**settings.TXQUEUE, "POLL_INTERVAL": 60}
        Queue("spread-0").enqueue_many([{"n": n} for n in range(300)])
        # Not due at the first passes: idle until the burst's last one claims it.
        Queue("spread-7").enqueue({"later": True}, delay=0.5)
        started = time.monotonic()
        assert fifty_queues(hot=slow_handler, batch=10, burst=True).run() == 0
        assert time.monotonic() - started > 0.5  # the hot queue outlasted the delay
        assert Queue("spread-7").count(status=Status.DONE) == 1
        assert Queue("spread-0").count(status=Status.DONE) == 300
