"""django_txqueue.observe.reads: the read model of the admin's dashboard and stuck page (what
each row says, in how many queries). test_chart.py draws it.

test_admin.py shows the same through the pages; test_admin_scale.py at scale.
"""

import datetime as dt

from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_txqueue import Queue, Status, enqueue
from django_txqueue.models import Consumer, QueueItem
from django_txqueue.observe.reads import MINUTES, duration, overview, stuck_items

NOW = timezone.now


def make(queue, status=Status.READY, **fields):
    item = enqueue(queue, {"n": 1})
    QueueItem.objects.filter(pk=item.pk).update(status=status, **fields)
    return QueueItem.objects.get(pk=item.pk)


def claimed(queue, pid, *, lease_minutes=5, claimed_minutes_ago=1):
    """An IN_PROGRESS item of ``pid``, its lease ending in ``lease_minutes`` (negative:
    expired that long ago)."""
    return make(
        queue,
        Status.IN_PROGRESS,
        pid=pid,
        claim_token=7,
        claimed_at=NOW() - dt.timedelta(minutes=claimed_minutes_ago),
        lease_expires_at=NOW() + dt.timedelta(minutes=lease_minutes),
    )


def consumer(identity, queues=(), *, silent_minutes=0, stopped=False):
    return Consumer.objects.create(
        identity=identity,
        host="h",
        os_pid=1,
        queues=list(queues),
        last_heartbeat_at=NOW() - dt.timedelta(minutes=silent_minutes),
        stopped_at=NOW() if stopped else None,
    )


def read():
    return overview(QueueItem.objects.all(), Consumer.objects.all())


def rows(found):
    return {row.name: row for row in found.queues}


class TestOverview:
    def test_rows_sorted_by_name_with_their_counts(self, db):
        consumer("c:live", ["b"])
        make("b")
        make("b", run_at=NOW() + dt.timedelta(hours=1))  # not due: READY all the same
        claimed("a", "c:live")
        claimed("a", "c:nobody", lease_minutes=-1)  # stuck: its lease expired
        make("a", Status.FAILED, finished_at=NOW())
        found = read()
        assert [row.name for row in found.queues] == ["a", "b"]
        a, b = rows(found)["a"], rows(found)["b"]
        assert (a.ready, a.in_progress, a.failed, a.stuck) == (0, 2, 1, 1)
        assert (b.ready, b.in_progress, b.failed, b.stuck) == (2, 0, 0, 0)
        assert (a.consumers, b.consumers, found.consumers) == (0, 1, 1)

    def test_only_live_consumers_count_and_their_queues_show_even_when_empty(self, db):
        consumer("c:1", ["idle", "busy"])
        consumer("c:2", ["busy"])
        consumer("c:silent", ["busy"], silent_minutes=10)
        consumer("c:stopped", ["busy"], stopped=True)
        make("busy")
        found = read()
        assert found.consumers == 2
        assert {name: row.consumers for name, row in rows(found).items()} == {
            "busy": 2,
            "idle": 1,
        }
        idle = rows(found)["idle"]
        assert (idle.ready, idle.in_progress, idle.failed, idle.oldest_ready_text) == (0, 0, 0, "")

    def test_a_queue_finished_over_an_hour_ago_has_no_row(self, db):
        make("old", Status.DONE, finished_at=NOW() - dt.timedelta(hours=2))
        make("recent", Status.DONE, finished_at=NOW() - dt.timedelta(minutes=2))
        found = read()
        assert list(rows(found)) == ["recent"]
        assert (rows(found)["recent"].done_last_hour, found.peak) == (1, 1)

    def test_the_oldest_ready_item_waited_since_its_run_at(self, db):
        make("a", run_at=NOW() - dt.timedelta(minutes=90))
        make("a")
        row = rows(read())["a"]
        assert dt.timedelta(minutes=90) <= row.oldest_ready < dt.timedelta(minutes=91)
        assert row.oldest_ready_text == "1 h 30 min"

    def test_a_minute_per_bar_the_last_one_now_and_the_busiest_one_is_the_peak(self, db):
        now = NOW()
        earlier = now - dt.timedelta(minutes=3)
        for finished_at, status in (
            (now, Status.DONE),
            (earlier, Status.FAILED),
            (earlier, Status.DONE),
        ):
            make("a", status, finished_at=finished_at)
        found = read()
        assert len(found.minutes) == MINUTES
        starts = [minute.start for minute in found.minutes]
        # The last bar is the minute the read began in, which may be just behind NOW() now.
        assert starts == sorted(starts) and now.replace(second=0, microsecond=0) <= starts[-1]
        assert starts[-1] <= NOW() < starts[-1] + dt.timedelta(minutes=2)
        assert {start.utcoffset() for start in starts} == {dt.timedelta(0)}  # cut in UTC
        by_start = {minute.start: (minute.done, minute.failed) for minute in found.minutes}
        assert by_start[now.replace(second=0, microsecond=0)] == (1, 0)
        assert by_start[earlier.replace(second=0, microsecond=0)] == (1, 1)
        assert sum(m.done + m.failed for m in found.minutes) == 3
        assert found.peak == 2
        assert (rows(found)["a"].done_last_hour, rows(found)["a"].failed_last_hour) == (2, 1)

    def test_fair_and_ordered_queues_carry_their_keys_and_plain_ones_none(self, db):
        for key, n in (("heavy", 3), ("light", 1)):
            Queue("ordered").enqueue_many([{}] * n, key=key)
        enqueue("plain", {})
        found = read()
        assert rows(found)["plain"].keys is None
        assert [row.name for row in found.keyed] == ["ordered"]
        assert rows(found)["ordered"].keys == {
            "keys_waiting": 2,
            "top_keys": [["heavy", 3], ["light", 1]],
        }

    def test_seven_queries_and_one_more_per_keyed_queue(self, db):
        def queries():
            with CaptureQueriesContext(connection) as captured:
                read()
            return len(captured)

        for n in range(5):
            make(f"plain{n}", Status.FAILED, finished_at=NOW())
            claimed(f"plain{n}", "c:gone", lease_minutes=-1)
        consumer("c:1", ["plain0"])
        plain = queries()
        assert plain == 7  # the seventh: the running items that report progress
        enqueue("fair", {}, key="k")
        enqueue("ordered", {}, key="k")
        assert queries() == plain + 2


class TestStuckItems:
    def test_each_with_why_and_since_when_longest_claimed_first(self, db, settings):
        settings.TXQUEUE = {**settings.TXQUEUE, "CONSUMER_TIMEOUT": 60}
        consumer("c:silent", silent_minutes=5)
        consumer("c:stopped", stopped=True)
        consumer("c:live")
        expired = claimed("q", "c:nobody", lease_minutes=-2, claimed_minutes_ago=10)
        silent = claimed("q", "c:silent", claimed_minutes_ago=20)
        stopped_and_expired = claimed("q", "c:stopped", lease_minutes=-3, claimed_minutes_ago=30)
        claimed("q", "c:live")  # running under a live consumer: not stuck
        found = stuck_items(QueueItem.objects.all(), Consumer.objects.all(), limit=10)
        assert [row.item.pk for row in found] == [stopped_and_expired.pk, silent.pk, expired.pk]
        by_pk = {row.item.pk: row for row in found}

        row = by_pk[expired.pk]
        assert (row.consumer, row.reason) == (None, "lease expired")
        assert 115 < row.overdue.total_seconds() < 125 and row.overdue_text == "2 min"

        row = by_pk[silent.pk]
        assert (row.consumer.identity, row.reason) == ("c:silent", "consumer stopped heartbeating")
        # Silent for 5 minutes, dead after CONSUMER_TIMEOUT (60 s): stuck for about 4.
        assert 235 < row.overdue.total_seconds() < 245

        row = by_pk[stopped_and_expired.pk]
        # Both, the earlier first: its lease expired 3 minutes ago, its consumer just stopped.
        assert row.reason == "lease expired; consumer stopped"
        assert 175 < row.overdue.total_seconds() < 185

    def test_at_most_limit_rows(self, db):
        for minutes in range(5):
            claimed("q", "c:nobody", lease_minutes=-1, claimed_minutes_ago=10 + minutes)
        found = stuck_items(QueueItem.objects.all(), Consumer.objects.all(), limit=3)
        claimed_at = [row.item.claimed_at for row in found]
        assert len(found) == 3 and claimed_at == sorted(claimed_at)

    def test_none_stuck(self, db):
        claimed("q", "c:nobody")
        assert stuck_items(QueueItem.objects.all(), Consumer.objects.all(), limit=10) == []


def test_duration():
    assert duration(dt.timedelta(seconds=0.4)) == "0 s"
    assert duration(dt.timedelta(seconds=45)) == "45 s"
    assert duration(dt.timedelta(minutes=3, seconds=12)) == "3 min 12 s"
    assert duration(dt.timedelta(hours=2, minutes=5, seconds=9)) == "2 h 5 min"
    assert duration(dt.timedelta(days=3)) == "3 d"
