"""rotation.py: which queue a consumer claims from next. Queues in turn, so that a busy
one cannot starve the others; the orphaned on_commit calls at start, when the others are
idle and at least every POLL_INTERVAL; queues found as they come."""

import time

from django_txqueue import Queue
from django_txqueue.outbox import QUEUE as OUTBOX
from django_txqueue.rotation import Rotation


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
    monkeypatch.setattr("django_txqueue.rotation.DISCOVERY_INTERVAL", 60)
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
