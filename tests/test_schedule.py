"""Periodic items (TXQUEUE["SCHEDULE"], README: Periodic items): the ticks of CRON and EVERY
entries, daylight-saving changes as cronsim documents them, one item per tick however many
consumers look (real processes), the start-up catch-up, TASK entries, the system checks,
``txqueue_schedule`` and the dashboard."""

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
from io import StringIO
from zoneinfo import ZoneInfo

import pytest
from django.core.management import call_command
from django.db import DatabaseError
from django.test.utils import override_settings
from django.urls import reverse

from django_txqueue import Queue, Status, store
from django_txqueue.checks import check_settings
from django_txqueue.models import ScheduleTick
from django_txqueue.schedule import KEEP_TICKS, Entry, Scheduler, overview
from django_txqueue.tasks.backend import TASKS_FRAMEWORK

from .helpers import FAST, ROOT, child_env, kill_tree, running, wait_for, worker_for

UTC = dt.UTC
NEW_YORK = ZoneInfo("America/New_York")


def at(*args, tz=UTC):
    return dt.datetime(*args, tzinfo=tz)


def schedule(**entries_by_name):
    """override_settings with TXQUEUE["SCHEDULE"] set (and the test settings kept)."""
    from django.conf import settings

    return override_settings(TXQUEUE={**settings.TXQUEUE, "SCHEDULE": entries_by_name})


def next_runs(entry, start, count):
    runs, moment = [], start
    for _ in range(count):
        moment = entry.next_after(moment)
        runs.append(moment)
    return runs


# -- ticks ---------------------------------------------------------------------------------


class TestTicks:
    def test_every_ticks_are_multiples_of_the_interval_since_the_epoch(self):
        entry = Entry(name="e", queue="q", every=60)
        moment = at(2026, 11, 25, 10, 0, 42, 5000)
        assert entry.latest(moment) == at(2026, 11, 25, 10, 0)
        assert entry.next_after(moment) == at(2026, 11, 25, 10, 1)
        assert entry.next_after(at(2026, 11, 25, 10, 1)) == at(2026, 11, 25, 10, 2)
        assert entry.ticks(at(2026, 11, 25, 10, 0), at(2026, 11, 25, 10, 3)) == [
            at(2026, 11, 25, 10, 1),
            at(2026, 11, 25, 10, 2),
            at(2026, 11, 25, 10, 3),
        ]
        # Every host, whenever it started, gets the same instants.
        seven = Entry(name="s", queue="q", every=7)
        assert all(
            int(t.timestamp()) % 7 == 0 for t in seven.ticks(moment, moment.replace(minute=5))
        )

    def test_cron_ticks_are_read_in_time_zone(self, settings):
        settings.TIME_ZONE = "Europe/Riga"
        entry = Entry(name="e", queue="q", cron="0 3 * * *")
        # 03:00 in Riga is 01:00 UTC in winter (UTC+2).
        assert entry.next_after(at(2026, 11, 25, 12, 0)) == at(2026, 11, 26, 1, 0)
        assert entry.latest(at(2026, 11, 25, 12, 0)) == at(2026, 11, 25, 1, 0)
        assert entry.ticks(at(2026, 11, 24, 12), at(2026, 11, 26, 12)) == [
            at(2026, 11, 25, 1, 0),
            at(2026, 11, 26, 1, 0),
        ]

    def test_a_daily_cron_across_spring_forward_runs_at_the_first_time_that_exists(self, settings):
        # cronsim's README (as Debian's cron): a job of a specific time whose time is
        # skipped by the change runs right after it. 02:30 does not exist on 2026-03-08
        # in New York: that day it runs at 03:00 EDT.
        settings.TIME_ZONE = "America/New_York"
        entry = Entry(name="e", queue="q", cron="30 2 * * *")
        runs = next_runs(entry, at(2026, 3, 6, 12, tz=NEW_YORK), 4)
        assert [run.astimezone(NEW_YORK) for run in runs] == [
            at(2026, 3, 7, 2, 30, tz=NEW_YORK),
            at(2026, 3, 8, 3, 0, tz=NEW_YORK),
            at(2026, 3, 9, 2, 30, tz=NEW_YORK),
            at(2026, 3, 10, 2, 30, tz=NEW_YORK),
        ]
        assert [run.utcoffset() for run in (r.astimezone(NEW_YORK) for r in runs)] == [
            dt.timedelta(hours=-5),
            dt.timedelta(hours=-4),
            dt.timedelta(hours=-4),
            dt.timedelta(hours=-4),
        ]
        # 24 hours apart, but 23 across the change (03:00 EDT is 07:00 UTC, as 02:00 EST).
        assert runs[1] - runs[0] == dt.timedelta(hours=23, minutes=30)

    def test_a_daily_cron_across_fall_back_runs_once(self, settings):
        # 01:30 happens twice on 2026-11-01 in New York: "care is taken to avoid running
        # jobs twice" (cronsim's README, quoting Debian's cron): the first one only.
        settings.TIME_ZONE = "America/New_York"
        entry = Entry(name="e", queue="q", cron="30 1 * * *")
        runs = next_runs(entry, at(2026, 10, 30, 12, tz=NEW_YORK), 3)
        assert runs == [
            at(2026, 10, 31, 5, 30),  # 01:30 EDT
            at(2026, 11, 1, 5, 30),  # 01:30 EDT, the first of the two
            at(2026, 11, 2, 6, 30),  # 01:30 EST
        ]
        assert entry.ticks(at(2026, 10, 31, 12), at(2026, 11, 2, 12)) == runs[1:]

    def test_a_cron_finer_than_an_hour_is_scheduled_normally_across_both_changes(self, settings):
        # "Jobs that run more frequently are scheduled normally": every half hour runs in
        # both passes of the repeated hour, and not in the skipped one.
        settings.TIME_ZONE = "America/New_York"
        entry = Entry(name="e", queue="q", cron="*/30 * * * *")
        fall = entry.ticks(at(2026, 11, 1, 4, 45), at(2026, 11, 1, 7, 15))
        assert fall == [
            at(2026, 11, 1, 5, 0),  # 01:00 EDT
            at(2026, 11, 1, 5, 30),  # 01:30 EDT
            at(2026, 11, 1, 6, 0),  # 01:00 EST
            at(2026, 11, 1, 6, 30),  # 01:30 EST
            at(2026, 11, 1, 7, 0),  # 02:00 EST
        ]
        spring = entry.ticks(at(2026, 3, 8, 6, 15), at(2026, 3, 8, 7, 45))
        assert [tick.astimezone(NEW_YORK) for tick in spring] == [
            at(2026, 3, 8, 1, 30, tz=NEW_YORK),  # 06:30 UTC
            at(2026, 3, 8, 3, 0, tz=NEW_YORK),  # 07:00 UTC: 02:00 and 02:30 do not exist
            at(2026, 3, 8, 3, 30, tz=NEW_YORK),
        ]

    def test_latest_in_the_second_pass_of_a_repeated_hour(self, settings):
        settings.TIME_ZONE = "America/New_York"
        entry = Entry(name="e", queue="q", cron="30 1 * * *")
        # 01:10 EST, the second pass: today's 01:30 EDT was 40 minutes ago.
        assert entry.latest(at(2026, 11, 1, 6, 10)) == at(2026, 11, 1, 5, 30)
        assert entry.latest(at(2026, 11, 1, 5, 29)) == at(2026, 10, 31, 5, 30)

    def test_a_late_look_gets_the_latest_ticks_only_up_to_a_bound(self):
        entry = Entry(name="e", queue="q", every=1)
        ticks = entry.ticks(at(2026, 1, 1), at(2026, 1, 2))
        assert len(ticks) == 100 and ticks[-1] == at(2026, 1, 2)


# -- enqueueing ticks ------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
class TestEnqueueTick:
    def test_a_tick_is_enqueued_once_with_its_tick_row(self):
        tick = at(2026, 11, 25, 10, 0)
        made = []

        def enqueue():
            item = Queue("ops").enqueue({"n": len(made)}, run_at=tick)
            made.append(item)
            return item.pk

        first = store.enqueue_tick(ScheduleTick, "beat", tick, "default", enqueue)
        second = store.enqueue_tick(ScheduleTick, "beat", tick, "default", enqueue)

        assert first == made[0].pk and second is None and len(made) == 1
        row = ScheduleTick.objects.get()
        assert (row.name, row.tick, row.item_id) == ("beat", tick, first)
        assert Queue("ops").items.get().run_at == tick

    def test_an_enqueue_that_fails_leaves_no_tick_row(self):
        def enqueue():
            Queue("ops").enqueue({"n": 1})
            raise ValueError("refused")

        with pytest.raises(ValueError, match="refused"):
            store.enqueue_tick(ScheduleTick, "beat", at(2026, 1, 1), "default", enqueue)
        assert not ScheduleTick.objects.exists() and not Queue("ops").items.exists()


def looked(scheduler, name, ago):
    """Pretend ``scheduler`` looked at entry ``name`` ``ago`` seconds ago."""
    scheduler.since[name] = dt.datetime.now(UTC) - dt.timedelta(seconds=ago)


@pytest.mark.django_db(transaction=True)
class TestScheduler:
    def test_a_running_consumer_covers_every_tick_since_its_previous_look(self):
        with schedule(beat={"queue": "ops", "every": 1}):  # lower case keys too
            scheduler = Scheduler("default")
            looked(scheduler, "beat", 5.5)
            wait = scheduler.look(["ops"])
        run_ats = sorted(Queue("ops").items.values_list("run_at", flat=True))
        assert len(run_ats) in (5, 6)
        assert all(
            later - earlier == dt.timedelta(seconds=1)
            for earlier, later in zip(run_ats, run_ats[1:], strict=False)
        )
        assert all(run_at.microsecond == 0 for run_at in run_ats)
        assert 0 <= wait <= 1
        ticks = dict(ScheduleTick.objects.values_list("tick", "item_id"))
        assert ticks == dict(Queue("ops").items.values_list("run_at", "pk"))

    def test_a_second_consumer_enqueues_nothing_more(self):
        with schedule(beat={"QUEUE": "ops", "EVERY": 1}):
            one, two = Scheduler("default"), Scheduler("default")
            looked(one, "beat", 3.5)
            looked(two, "beat", 3.5)
            one.look(["ops"])
            two.look(["ops"])
        run_ats = list(Queue("ops").items.values_list("run_at", flat=True))
        assert len(run_ats) == len(set(run_ats)) >= 3

    def test_at_start_up_only_the_latest_missed_tick_is_enqueued(self):
        now = dt.datetime.now(UTC)
        ScheduleTick.objects.create(name="beat", tick=now - dt.timedelta(hours=1))
        with schedule(beat={"QUEUE": "ops", "EVERY": 60, "PAYLOAD": {"p": 1}, "PRIORITY": 3}):
            Scheduler("default").look(["ops"])
            Scheduler("default").look(["ops"])  # a second consumer starting: done already
        item = Queue("ops").items.get()
        assert item.run_at == Entry(name="beat", every=60).latest(dt.datetime.now(UTC))
        assert (item.payload, item.priority) == ({"p": 1}, 3)

    def test_a_new_entry_starts_with_its_next_tick(self):
        with schedule(beat={"QUEUE": "ops", "EVERY": 60}):
            Scheduler("default").look(["ops"])
        assert not Queue("ops").items.exists()

    def test_only_consumers_of_the_queue_on_its_database_enqueue(self):
        with schedule(beat={"QUEUE": "ops", "EVERY": 1}):
            elsewhere, other_queues = Scheduler("other"), Scheduler("default")
            looked(elsewhere, "beat", 3)
            looked(other_queues, "beat", 3)
            elsewhere.look(["ops"])
            other_queues.look(["sms", "echo"])
        assert not Queue("ops").items.exists() and not ScheduleTick.objects.exists()

    def test_the_tick_rows_are_trimmed_to_the_latest_few(self):
        with schedule(beat={"QUEUE": "ops", "EVERY": 1}):
            scheduler = Scheduler("default")
            looked(scheduler, "beat", 30)
            scheduler.look(["ops"])
        assert Queue("ops").items.count() >= 30
        ticks = list(ScheduleTick.objects.order_by("tick").values_list("tick", flat=True))
        assert len(ticks) == KEEP_TICKS
        assert ticks[-1] == Queue("ops").items.latest("run_at").run_at

    def test_a_database_error_loses_no_tick(self, monkeypatch):
        with schedule(beat={"QUEUE": "ops", "EVERY": 1}):
            scheduler = Scheduler("default")
            looked(scheduler, "beat", 2.5)
            real = store.enqueue_tick

            def refused(*args, **kwargs):
                raise DatabaseError("server gone")

            monkeypatch.setattr(store, "enqueue_tick", refused)
            with pytest.raises(DatabaseError):
                scheduler.look(["ops"])
            monkeypatch.setattr(store, "enqueue_tick", real)
            scheduler.look(["ops"])
        assert Queue("ops").items.count() >= 2


@pytest.mark.django_db(transaction=True)
def test_a_consumer_enqueues_the_ticks_from_its_liveness_thread(fast_consumers, settings):
    settings.TXQUEUE = {**settings.TXQUEUE, "SCHEDULE": {"beat": {"QUEUE": "noop", "EVERY": 1}}}
    ScheduleTick.objects.create(name="beat", tick=at(2026, 1, 1))  # enqueued before
    worker = worker_for("noop")
    with running(worker):
        assert wait_for(lambda: Queue("noop").count(Status.DONE) >= 3, 10)
    run_ats = sorted(Queue("noop").items.values_list("run_at", flat=True))
    # The latest tick missed at start-up, then each tick (none lost, none twice).
    assert all(
        later - earlier == dt.timedelta(seconds=1)
        for earlier, later in zip(run_ats, run_ats[1:], strict=False)
    )


@pytest.mark.skipif(TASKS_FRAMEWORK is None, reason="no Django Tasks framework")
@pytest.mark.django_db(transaction=True)
def test_a_task_entry_enqueues_the_task_and_it_runs(run_consumer):
    from django_txqueue.tasks.backend import TxQueueBackend

    with schedule(
        adding={"TASK": "tests.testapp.tasks.add", "ARGS": [2], "KWARGS": {"b": 3}, "EVERY": 3600}
    ):
        scheduler = Scheduler("default")
        looked(scheduler, "adding", 3600)  # one tick since
        scheduler.look(["default"])
        item = Queue("default").items.get()
        assert item.payload["task"] == "tests.testapp.tasks.add"
        assert item.run_at == ScheduleTick.objects.get().tick
        assert ScheduleTick.objects.get().item_id == item.pk
    run_consumer("default", "--burst")
    from tests.testapp import tasks

    result = tasks.add.get_backend().get_result(str(item.pk))
    assert isinstance(tasks.add.get_backend(), TxQueueBackend)
    assert result.status == "SUCCESSFUL" and result.return_value == 5


# -- checks ----------------------------------------------------------------------------------


def check_messages(**entries_by_name):
    with schedule(**entries_by_name):
        return [(message.id, message.msg) for message in check_settings()]


class TestChecks:
    def test_good_entries_pass(self):
        assert (
            check_messages(
                nightly={"QUEUE": "reports", "CRON": "0 3 * * *", "PAYLOAD": {"a": 1}},
                beat={"queue": "ops", "every": 60, "priority": -1, "key": "k"},
                adding={"TASK": "tests.testapp.tasks.add", "ARGS": [1, 2], "EVERY": 5},
            )
            == []
        )

    @pytest.mark.parametrize(
        ("options", "code", "words"),
        [
            ({"QUEUE": "q", "EVERY": 1, "CRONN": "x"}, "txqueue.E007", "unknown key 'CRONN'"),
            ({"QUEUE": "q", "CRON": "61 * * * *"}, "txqueue.E008", "Bad minute"),
            ({"QUEUE": "q", "CRON": "* * *"}, "txqueue.E008", "Wrong number of fields"),
            ({"QUEUE": "q", "CRON": "* * * * *", "EVERY": 5}, "txqueue.E008", "one of them"),
            ({"QUEUE": "q"}, "txqueue.E008", "one of them"),
            ({"QUEUE": "q", "EVERY": 0}, "txqueue.E008", "EVERY is 0"),
            ({"QUEUE": "q", "EVERY": 5, "CATCH_UP": "all"}, "txqueue.E008", "CATCH_UP is 'all'"),
            ({"EVERY": 5}, "txqueue.E009", "give QUEUE"),
            ({"QUEUE": "q", "EVERY": 5, "PAYLOAD": {1, 2}}, "txqueue.E009", "set"),
            ({"QUEUE": "q", "EVERY": 5, "PRIORITY": "high"}, "txqueue.E009", "PRIORITY"),
            (
                {"TASK": "tests.testapp.tasks.add", "QUEUE": "q", "EVERY": 5},
                "txqueue.E009",
                "QUEUE",
            ),
            ({"TASK": "tests.testapp.tasks.nope", "EVERY": 5}, "txqueue.E010", "nope"),
            ({"TASK": "no.such.module.task", "EVERY": 5}, "txqueue.E010", "no.such.module"),
        ],
    )
    def test_a_bad_entry_is_an_error_naming_it(self, options, code, words):
        messages = check_messages(broken=options)
        assert [found for found, _ in messages] == [code], messages
        assert "TXQUEUE['SCHEDULE']['broken']" in messages[0][1]
        assert words in messages[0][1]

    def test_schedule_must_be_a_dict(self):
        from django.conf import settings

        with override_settings(TXQUEUE={**settings.TXQUEUE, "SCHEDULE": ["x"]}):
            assert [message.id for message in check_settings()] == ["txqueue.E003"]


# -- what people see -------------------------------------------------------------------------


@pytest.mark.django_db
def test_the_command_lists_each_entry_with_its_last_and_next_run(settings):
    settings.TIME_ZONE = "Europe/Riga"
    ScheduleTick.objects.create(name="nightly", tick=at(2026, 11, 25, 1, 0))
    with schedule(
        nightly={"QUEUE": "reports", "CRON": "0 3 * * *"},
        beat={"QUEUE": "ops", "EVERY": 60},
    ):
        out = StringIO()
        call_command("txqueue_schedule", stdout=out)
        upcoming = {row.name: row.next_run for row in overview()}
    lines = out.getvalue().splitlines()
    assert lines[0].split() == ["entry", "enqueues", "schedule", "last", "run", "next", "run"]
    beat, nightly = lines[1], lines[2]
    assert beat.startswith("beat") and "queue ops" in beat and "every 60 s" in beat
    assert "never" in beat
    assert nightly.startswith("nightly") and "cron 0 3 * * * (Europe/Riga)" in nightly
    assert "2026-11-25 03:00:00+02:00" in nightly  # its last run, in TIME_ZONE
    next_nightly = upcoming["nightly"].astimezone(ZoneInfo("Europe/Riga"))
    assert next_nightly.isoformat(sep=" ") in nightly and next_nightly.hour == 3


@pytest.mark.django_db
def test_the_command_without_entries():
    out = StringIO()
    with schedule():
        call_command("txqueue_schedule", stdout=out)
    assert "No schedule entries" in out.getvalue()


@pytest.mark.django_db
def test_the_dashboard_shows_the_entries(admin_client):
    ScheduleTick.objects.create(name="beat<b>", tick=at(2026, 11, 25, 10, 0))
    with schedule(
        **{
            "beat<b>": {"QUEUE": "ops", "EVERY": 60},
            "nightly": {"QUEUE": "r", "CRON": "0 3 * * *"},
        }
    ):
        response = admin_client.get(reverse("admin:django_txqueue_dashboard_changelist"))
        fragment = admin_client.get(
            reverse("admin:django_txqueue_dashboard_changelist") + "?fragment=1"
        )
    content = response.content.decode()
    assert response.status_code == 200
    assert 'id="schedule-table"' in content
    rows = {row.name: row for row in response.context["schedule"]}
    assert rows["beat<b>"].last_run == at(2026, 11, 25, 10, 0)
    assert rows["nightly"].last_run is None and rows["nightly"].next_run is not None
    assert "beat&lt;b&gt;" in content and "beat<b>" not in content  # escaped
    assert "every 60 s" in content and "cron 0 3 * * *" in content and "never" in content
    assert "2026-11-25 10:00:00" in content
    assert 'id="schedule-table"' not in fragment.content.decode()


# -- real consumers --------------------------------------------------------------------------

SECONDS = 10


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_four_consumers_enqueue_each_tick_of_an_every_second_entry_once(tmp_path):
    settings = {**FAST, "SCHEDULE": {"beat": {"QUEUE": "noop", "EVERY": 1}}}
    env = {**child_env(), "TXQUEUE_TEST_SETTINGS": json.dumps(settings)}
    procs = []
    try:
        for n in range(4):
            with (tmp_path / f"c{n}.err").open("wb") as err:
                procs.append(
                    subprocess.Popen(  # noqa: S603 - our own command line
                        [sys.executable, "-m", "django", "run_queue_consumer", "noop"],
                        env=env,
                        cwd=ROOT,
                        stdout=subprocess.DEVNULL,
                        stderr=err,
                        start_new_session=True,
                    )
                )
        from django_txqueue.models import Consumer

        started = wait_for(
            lambda: Consumer.objects.filter(stopped_at__isnull=True).count() == 4, 30, interval=0.1
        )
        assert started, "\n".join((tmp_path / f"c{n}.err").read_text() for n in range(4))
        begin = dt.datetime.now(UTC)
        time.sleep(SECONDS)
        end = dt.datetime.now(UTC)
        for proc in procs:
            os.kill(proc.pid, signal.SIGTERM)
        for proc in procs:
            assert proc.wait(timeout=30) == 0
    finally:
        for proc in procs:
            kill_tree(proc)
    errors = "\n".join((tmp_path / f"c{n}.err").read_text() for n in range(4))
    run_ats = list(Queue("noop").items.values_list("run_at", flat=True))
    assert len(run_ats) == len(set(run_ats)), f"a tick enqueued twice\n{errors}"
    # The ticks of the ten seconds, but the last half second's: the consumers were told to
    # stop right after it, maybe before their look at a tick due just then.
    until = end - dt.timedelta(seconds=0.5)
    window = {t for t in run_ats if begin < t <= until}
    first = begin.replace(microsecond=0) + dt.timedelta(seconds=1)
    expected = {first + dt.timedelta(seconds=n) for n in range(SECONDS + 1)}
    expected = {t for t in expected if t <= until}
    assert len(expected) >= SECONDS - 1
    assert window == expected, f"gaps: {sorted(expected - window)}\n{errors}"
    assert Queue("noop").count(Status.DONE) >= SECONDS - 2  # and they ran
    assert "Traceback" not in errors and "IntegrityError" not in errors, errors


@pytest.mark.django_db(transaction=True)
def test_a_tick_whose_item_does_not_fit_is_skipped_and_the_others_go_on(caplog):
    with schedule(
        full={"QUEUE": "bounded", "EVERY": 3600},
        broken={"TASK": "tests.testapp.tasks.nope", "EVERY": 3600},
        fine={"QUEUE": "ops", "EVERY": 3600},
    ):
        Queue("bounded").enqueue_many([{}, {}, {}])  # MAX_SIZE 3 (tests/settings.py)
        scheduler = Scheduler("default")
        for name in ("full", "broken", "fine"):
            looked(scheduler, name, 3600)
        scheduler.look(["bounded", "ops", "default"])
    assert Queue("bounded").count() == 3 and Queue("ops").count() == 1
    assert list(ScheduleTick.objects.values_list("name", flat=True)) == ["fine"]
    assert "schedule entry 'full': could not enqueue" in caplog.text
    assert "schedule entry 'broken' is not enqueued" in caplog.text
