"""``RATE_LIMIT`` and ``RATE_LIMIT_PER_KEY`` (docs/limits.md): claims never take more than
the budget left in the period, across every consumer; items over it stay READY, charged
nothing, and are claimed once the budget has room."""

import io
import time
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.db import transaction
from django.utils import timezone

from django_txqueue import Queue, Status
from django_txqueue.checks import check_settings
from django_txqueue.consumer.worker import Worker
from django_txqueue.contrib.chaos.verify import most_in_any_stretch
from django_txqueue.models import QueueItem, QueueRate
from django_txqueue.store import rates
from django_txqueue.validation import Rate, parse_rate

from .test_admin import DASHBOARD

LONG = 600


def limited(queue, settings, **options):
    settings.TXQUEUE = {**settings.TXQUEUE, "QUEUES": {queue.name: options}}
    return queue


def test_rates_are_parsed_and_bad_ones_named():
    assert parse_rate("50/s") == Rate(50, 1)
    assert parse_rate(" 10 / m ") == Rate(10, 60)
    assert str(parse_rate("1000/h")) == "1000/h"
    for bad in ("0/s", "10/d", "ten/s", "10", 10, None):
        with pytest.raises(ValueError, match="'N/s', 'N/m' or 'N/h'"):
            parse_rate(bad)


def test_rate_limits_are_checked(settings):
    settings.TXQUEUE = {"QUEUES": {"sms": {"RATE_LIMIT": "50 a second", "rate_limit_per_key": 5}}}
    found = sorted(m.msg for m in check_settings() if m.id == "txqueue.E003")
    assert found == [
        "TXQUEUE['QUEUES']['sms']['RATE_LIMIT'] is '50 a second'; it must be None or a rate "
        "such as '50/s', '10/m'.",
        "TXQUEUE['QUEUES']['sms']['rate_limit_per_key'] is 5; it must be None or a rate "
        "such as '50/s', '10/m'.",
    ]


@pytest.mark.django_db
def test_a_claim_takes_no_more_than_the_budget_left(queue, settings):
    limited(queue, settings, RATE_LIMIT="3/m")
    queue.enqueue_many([{"n": n} for n in range(5)])
    first = queue.claim(2, pid="a", lease=LONG)
    assert [item.payload for item in first] == [{"n": 0}, {"n": 1}]
    assert [item.payload for item in queue.claim(10, pid="b", lease=LONG)] == [{"n": 2}]
    for item in first:
        assert item.ack() is True  # finishing frees no budget: it counts claims
    assert queue.claim(10, pid="c", lease=LONG) == []
    waiting = QueueItem.objects.filter(queue=queue.name, status=Status.READY)
    assert sorted(waiting.values_list("attempts", flat=True)) == [0, 0]  # charged nothing


@pytest.mark.django_db
def test_what_a_consumer_did_not_claim_goes_back_to_the_budget(queue, settings):
    limited(queue, settings, RATE_LIMIT="5/m")
    queue.enqueue_many([{"n": n} for n in range(2)])
    # Each Queue claims under a grant of its own, as each consumer process does.
    assert len(Queue(queue.name).claim(10, pid="a", lease=LONG)) == 2
    queue.enqueue_many([{"n": n} for n in range(2, 8)])
    assert len(Queue(queue.name).claim(10, pid="b", lease=LONG)) == 3
    assert Queue(queue.name).claim(10, pid="c", lease=LONG) == []
    assert queue.stats()["rate_limit"] == {"limit": "5/m", "used": 5}


@pytest.mark.django_db
def test_the_budget_has_room_again_once_a_claim_leaves_the_period(queue, settings):
    limited(queue, settings, RATE_LIMIT="2/s")
    queue.enqueue_many([{"n": n} for n in range(3)])
    before = time.monotonic()
    assert len(queue.claim(10, pid="a", lease=LONG)) == 2
    assert queue.claim(10, pid="a", lease=LONG) == []
    after = time.monotonic()
    held_for = queue.claims.held_until - after
    # The consumer's wait: until the first claim's grant leaves the period, recorded at the
    # end of its span (a tenth of the period), so that it counts as long as the claim. From
    # before the claims, not after them: a loaded machine may take a while over the two.
    assert queue.claims.held_until - before > 0.9 and held_for <= 1.1
    time.sleep(max(held_for, 0) + 0.05)
    assert [item.payload for item in queue.claim(10, pid="a", lease=LONG)] == [{"n": 2}]


@pytest.mark.django_db
def test_the_period_slides(queue, settings):
    limited(queue, settings, RATE_LIMIT="4/s")
    queue.enqueue_many([{"n": n} for n in range(10)])
    claimed = queue.claim(2, pid="a", lease=LONG)
    time.sleep(0.6)
    claimed += queue.claim(10, pid="a", lease=LONG)
    assert len(claimed) == 4
    time.sleep(0.5)  # past the first claim's second, not the second one's
    claimed += queue.claim(10, pid="a", lease=LONG)
    assert len(claimed) == 6
    moments = QueueItem.objects.filter(pk__in=[i.pk for i in claimed]).values_list(
        "claimed_at", flat=True
    )
    assert most_in_any_stretch(list(moments), 1.0) == 4


@pytest.mark.django_db
def test_each_key_has_its_own_budget(queue, settings):
    limited(queue, settings, RATE_LIMIT_PER_KEY="2/m")
    queue.enqueue_many([{"n": n} for n in range(4)], key="alice")
    queue.enqueue_many([{"n": n} for n in range(4, 7)], key="bob")
    queue.enqueue({"n": 7})  # no key: not limited per key
    claimed = queue.claim(10, pid="a", lease=LONG)
    assert sorted(item.payload["n"] for item in claimed) == [0, 1, 4, 5, 7]
    assert queue.claim(10, pid="b", lease=LONG) == []  # alice and bob are passed over
    held = QueueItem.objects.filter(queue=queue.name, status=Status.READY)
    assert sorted(held.values_list("key", "attempts", "pid")) == [
        ("alice", 0, ""),
        ("alice", 0, ""),
        ("bob", 0, ""),
    ]
    budgets = QueueRate.objects.filter(queue=queue.name, per_key=True).exclude(key=rates.SHARED)
    assert sorted(budgets.values_list("key", "last_items")) == [("alice", 2), ("bob", 2)]
    assert all(budgets.values_list("full_until", flat=True))


@pytest.mark.django_db
def test_an_ample_key_budget_is_granted_and_claims_count_no_key(queue, settings):
    limited(queue, settings, RATE_LIMIT_PER_KEY="1000/m")
    queue.enqueue_many([{"n": n} for n in range(6)], key="alice")
    queue.enqueue_many([{"n": n} for n in range(6, 9)], key="bob")
    assert len(queue.claim(5, pid="a", lease=LONG)) == 5
    assert len(queue.claim(5, pid="a", lease=LONG)) == 4
    rows = QueueRate.objects.filter(queue=queue.name, per_key=True)
    assert list(rows.values_list("key", flat=True)) == [rates.SHARED]  # no key counted
    (grant,) = rows.get().claims
    assert grant[1] >= 6  # at least what a key took under it
    assert set(queue.items.values_list("attempts", flat=True)) == {1}


@pytest.mark.django_db
def test_a_claim_that_counts_its_keys_counts_every_grant_against_them(queue, settings):
    """A takes a grant of 4 items of every key; B, whose claims are too big for a grant,
    counts alice's budget of 10 with A's 4 in it; A's grant is given back down to what it
    took. Together they take the 10 of alice's budget, no more."""
    limited(queue, settings, RATE_LIMIT_PER_KEY="10/m")
    queue.enqueue_many([{"n": n} for n in range(20)], key="alice")
    a, b = Queue(queue.name), Queue(queue.name)
    assert len(a.claim(2, pid="a", lease=LONG)) == 2  # a grant of 4: half of 10 at most
    assert len(b.claim(10, pid="b", lease=LONG)) == 6  # 10 less A's grant
    assert len(a.claim(2, pid="a", lease=LONG)) == 2  # the rest of A's grant
    assert a.claim(2, pid="a", lease=LONG) == []  # nothing left: no grant, alice spent
    assert b.claim(10, pid="b", lease=LONG) == []
    assert queue.items.filter(status=Status.IN_PROGRESS).count() == 10
    assert (
        sorted(queue.items.filter(status=Status.READY).values_list("attempts", flat=True))
        == [0] * 10
    )


def key_budget(queue, rate, claimed_ago=None):
    """Lock and read ``queue``'s budget of key "k" as a claim made ``claimed_ago`` seconds
    before the read counts it (None: made at the read)."""
    claimed = None if claimed_ago is None else time.monotonic() - claimed_ago
    budgets = rates.lock_budgets(
        QueueRate, queue.name, ["k"], rate, per_key=True, using="default", claimed=claimed
    )
    return budgets["k"]


@pytest.mark.django_db
def test_a_key_claim_read_after_a_later_claims_still_counts_what_it_pruned(queue):
    """Claim B takes items of key k, then waits for k's budget while claim A, made after it,
    takes and records its own. A's period starts later than B's: what A leaves out of its
    count B must still find, or the two would take more than the budget in one second."""
    rate = Rate(2, 1)
    QueueRate.objects.create(
        queue=queue.name,
        per_key=True,
        key="k",
        last_at=timezone.now() - timedelta(seconds=1.2),
        last_items=2,
    )
    with transaction.atomic():  # A: its period has the 2 items of 1.2 s ago behind it
        a = key_budget(queue, rate)
        assert a.left == 2 and a.take()
        rates.record(QueueRate, [a], "default")
    with transaction.atomic():  # B: claimed 0.5 s ago, it counts those 2 and A's 1
        b = key_budget(queue, rate, claimed_ago=0.5)
        assert b.left == 0 and not b.take()


@pytest.mark.django_db
def test_a_key_claim_read_later_than_max_lag_after_it_takes_nothing(queue):
    with transaction.atomic():
        late = key_budget(queue, Rate(2, 1), claimed_ago=rates.MAX_LAG + 0.5)
        assert late.left == 2 and not late.take()
        rates.record(QueueRate, [late], "default")
    assert QueueRate.objects.get(queue=queue.name, key="k").last_items == 0


@pytest.mark.django_db
def test_a_key_claim_that_gave_its_items_back_is_held_not_idle(queue, settings, monkeypatch):
    """Its budgets read too late, a claim takes nothing and spends no key: the consumer
    claims again soon (the queue is held back, not idle), so that a burst run does not
    stop with the items READY."""
    limited(queue, settings, RATE_LIMIT_PER_KEY="2/m")
    queue.enqueue_many([{"n": n} for n in range(3)], key="alice")
    monkeypatch.setattr(rates, "MAX_LAG", -1.0)  # every read later than that
    assert queue.claim(10, pid="a", lease=LONG) == []
    assert 0 < queue.claims.held_until <= time.monotonic()
    waiting = QueueItem.objects.filter(queue=queue.name, status=Status.READY)
    assert list(waiting.values_list("attempts", flat=True)) == [0, 0, 0]
    monkeypatch.undo()
    assert len(queue.claim(10, pid="a", lease=LONG)) == 2


@pytest.mark.django_db
def test_a_key_spent_when_a_claim_ran_has_room_at_once_not_none(queue):
    """A claim passed a spent key over; its budget has room by the time the claim asks
    when: room now (0 s), not "no key spent", which would make the queue idle."""
    QueueRate.objects.create(
        queue=queue.name,
        per_key=True,
        key="k",
        full_until=timezone.now() - timedelta(seconds=0.5),
    )
    assert rates.seconds_to_room(QueueRate, queue.name, "default") is None
    sent = time.monotonic() - 2  # the claim ran 2 s ago, the key then spent
    assert rates.seconds_to_room(QueueRate, queue.name, "default", claimed=sent) == 0.0


@pytest.mark.django_db
def test_a_queue_and_its_keys_are_limited_together(queue, settings):
    limited(queue, settings, RATE_LIMIT="3/m", RATE_LIMIT_PER_KEY="2/m")
    queue.enqueue_many([{"n": n} for n in range(3)], key="alice")
    queue.enqueue_many([{"n": n} for n in range(3, 6)], key="bob")
    first = queue.claim(10, pid="a", lease=LONG)
    assert [item.payload["n"] for item in first] == [0, 1]  # 3 by the queue's, 2 alice's
    second = queue.claim(10, pid="a", lease=LONG)
    assert [item.payload["n"] for item in second] == [3]  # the queue's last one
    assert queue.claim(10, pid="a", lease=LONG) == []


@pytest.mark.django_db
def test_a_paused_limited_queue_spends_no_budget(queue, settings):
    limited(queue, settings, RATE_LIMIT="2/m")
    queue.enqueue_many([{"n": n} for n in range(3)])
    queue.pause()
    assert queue.claim(10, pid="a", lease=LONG) == []
    queue.resume()
    assert len(queue.claim(10, pid="a", lease=LONG)) == 2


@pytest.mark.django_db
def test_a_fair_queue_is_limited_per_key(queue, settings):
    limited(queue, settings, FAIR=True, RATE_LIMIT_PER_KEY="1/m")
    queue.enqueue_many([{"n": n} for n in range(3)], key="alice")
    queue.enqueue_many([{"n": n} for n in range(3, 5)], key="bob")
    claimed = queue.claim(10, pid="a", lease=LONG)
    assert sorted(item.payload["n"] for item in claimed) == [0, 3]
    assert queue.claim(10, pid="a", lease=LONG) == []


@pytest.mark.django_db(transaction=True)
def test_a_consumer_drains_a_limited_queue_at_its_rate(queue, settings):
    limited(queue, settings, RATE_LIMIT="10/s")
    queue.enqueue_many([{"n": n} for n in range(25)])
    worker = Worker({queue.name: lambda item: None}, concurrency=4, batch=4, burst=True)
    started = time.monotonic()
    assert worker.run() == 0
    took = time.monotonic() - started
    assert worker.processed == 25
    assert 2.0 <= took < 6  # 10, 10 a second later, 5 a second after: not polled late
    moments = QueueItem.objects.filter(queue=queue.name).values_list("claimed_at", flat=True)
    assert most_in_any_stretch(list(moments), 1.0) == 10
    assert set(QueueItem.objects.filter(queue=queue.name).values_list("attempts", flat=True)) == {
        1
    }


@pytest.mark.django_db
def test_the_limit_and_its_use_are_shown(queue, settings, admin_client):
    limited(queue, settings, RATE_LIMIT="5/m", RATE_LIMIT_PER_KEY="2/m")
    queue.enqueue_many([{"n": n} for n in range(4)], key="alice")
    assert len(queue.claim(10, pid="a", lease=LONG)) == 2
    stats = queue.stats()
    assert stats["rate_limit"] == {"limit": "5/m", "used": 2}
    assert stats["rate_limit_per_key"] == {"limit": "2/m", "keys_spent": 1}
    out = io.StringIO()
    call_command("txqueue_stats", queue.name, stdout=out)
    assert f"{queue.name}: RATE_LIMIT 5/m, 2 used in the last minute" in out.getvalue()
    assert f"{queue.name}: RATE_LIMIT_PER_KEY 2/m, 1 key spent" in out.getvalue()
    page = admin_client.get(DASHBOARD).content.decode()
    assert "2 / 5 a minute" in page
