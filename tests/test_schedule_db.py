"""Schedules in the database (docs/control.md: Periodic items): the ``Schedule`` model's
validation, its enabled rows enqueued by the same Scheduler as the settings' entries (once
per tick however many look, a change taken on the next look), catch-up, run now, and the
admin's pages."""

import datetime as dt
import io

import pytest
from django.contrib.auth.models import Permission, User
from django.core.exceptions import ValidationError
from django.core.management import call_command
from django.urls import reverse

from django_txqueue import Queue
from django_txqueue.models import Schedule, ScheduleTick
from django_txqueue.schedule import Entry, Scheduler, database_entries, run_now
from django_txqueue.testing import assert_enqueued

from .test_schedule import UTC, looked, schedule

CHANGELIST = reverse("admin:django_txqueue_schedule_changelist")
ADD = reverse("admin:django_txqueue_schedule_add")


def entry_row(**fields):
    return Schedule.objects.create(**{"name": "beat", "queue": "ops", "every": 1, **fields})


def problems(**fields):
    row = Schedule(**{"name": "beat", "queue": "ops", "every": 60, **fields})
    try:
        row.full_clean()
    except ValidationError as exc:
        return exc.message_dict
    return {}


@pytest.mark.django_db
class TestValidation:
    def test_a_good_row_passes(self):
        assert problems() == {}
        assert problems(every=None, cron="0 3 * * *", payload={"a": 1}, key="k") == {}

    @pytest.mark.parametrize(
        ("fields", "field", "words"),
        [
            ({"every": None}, "cron", "one of them"),
            ({"cron": "0 3 * * *"}, "cron", "one of them"),
            ({"every": None, "cron": "61 * * * *"}, "cron", "not a cron expression"),
            ({"every": 0}, "every", "greater than or equal to 1"),
            ({"queue": ""}, "queue", "a queue or a task"),
            ({"queue": "ops", "task": "tests.testapp.tasks.add"}, "queue", "one of them"),
            ({"queue": "a" * 101}, "queue", "100"),
            ({"args": [1]}, "args", "with a task only"),
            ({"catch_up": "all"}, "catch_up", "not a valid choice"),
        ],
    )
    def test_a_bad_row_is_refused_on_its_field(self, fields, field, words):
        found = problems(**fields)
        assert field in found and words in " ".join(found[field]), found

    def test_a_name_of_the_settings_is_refused(self):
        with schedule(beat={"QUEUE": "ops", "EVERY": 60}):
            assert "TXQUEUE" in problems()["name"][0]
            entry_row()  # saved behind validation's back: the settings entry wins
            assert database_entries() == []

    def test_the_database_refuses_both_timings(self):
        from django.db import IntegrityError, transaction

        with pytest.raises(IntegrityError), transaction.atomic():
            entry_row(cron="* * * * *")


@pytest.mark.django_db(transaction=True)
class TestScheduler:
    def test_two_schedulers_racing_enqueue_each_tick_once(self):
        entry_row(payload={"p": 1}, priority=2)
        one, two = Scheduler("default"), Scheduler("default")
        looked(one, "beat", 3.5)
        looked(two, "beat", 3.5)
        one.look(["ops"])
        two.look(["ops"])
        items = list(Queue("ops").items.values_list("run_at", "payload", "priority"))
        run_ats = [run_at for run_at, _, _ in items]
        assert len(run_ats) == len(set(run_ats)) >= 3
        assert {(payload["p"], priority) for _, payload, priority in items} == {(1, 2)}
        assert ScheduleTick.objects.filter(name="beat").count() == len(run_ats)

    def test_an_edit_takes_effect_on_the_next_look(self):
        row = entry_row(every=3600)
        scheduler = Scheduler("default")
        looked(scheduler, "beat", 3.5)
        scheduler.look(["ops"])
        assert not Queue("ops").items.exists()  # no hour boundary in 3.5 s (almost surely)
        row.every, row.payload = 1, {"edited": True}
        row.save()
        looked(scheduler, "beat", 2.5)
        scheduler.look(["ops"])
        assert Queue("ops").items.count() >= 2
        assert all(item.payload == {"edited": True} for item in Queue("ops").items.all())

    def test_a_disabled_row_is_not_enqueued_from_the_next_look(self):
        row = entry_row()
        scheduler = Scheduler("default")
        looked(scheduler, "beat", 2.5)
        scheduler.look(["ops"])
        before = Queue("ops").items.count()
        assert before >= 2
        row.enabled = False
        row.save()
        looked(scheduler, "beat", 3.5)
        scheduler.look(["ops"])
        assert Queue("ops").items.count() == before and "beat" not in scheduler.since

    @pytest.mark.parametrize(("catch_up", "made"), [("latest", 1), ("none", 0)])
    def test_catch_up_at_start_up(self, catch_up, made):
        ScheduleTick.objects.create(name="beat", tick=dt.datetime.now(UTC) - dt.timedelta(hours=1))
        entry_row(every=60, catch_up=catch_up)
        Scheduler("default").look(["ops"])
        Scheduler("default").look(["ops"])  # a second consumer starting
        latest = Entry(name="beat", every=60).latest(dt.datetime.now(UTC))
        assert_enqueued("ops", count=made, run_at=latest)
        assert_enqueued("ops", count=made)

    @pytest.mark.parametrize(("catch_up", "made"), [("latest", 1), ("none", 0)])
    def test_a_settings_entrys_catch_up_at_start_up(self, catch_up, made):
        ScheduleTick.objects.create(name="beat", tick=dt.datetime.now(UTC) - dt.timedelta(hours=1))
        with schedule(beat={"QUEUE": "ops", "EVERY": 60, "CATCH_UP": catch_up}):
            Scheduler("default").look(["ops"])
        assert_enqueued("ops", count=made)

    def test_settings_and_database_entries_run_side_by_side(self):
        entry_row(name="from-db")
        with schedule(settings_beat={"QUEUE": "ops", "EVERY": 1}):
            scheduler = Scheduler("default")
            looked(scheduler, "from-db", 2.5)
            looked(scheduler, "settings_beat", 2.5)
            scheduler.look(["ops"])
        names = set(ScheduleTick.objects.values_list("name", flat=True))
        assert names == {"from-db", "settings_beat"}

    def test_run_now_enqueues_one_item_due_now_and_no_tick(self):
        row = entry_row(every=3600, payload={"now": 1}, enabled=False)
        pk = run_now(row)
        [item] = assert_enqueued("ops", {"now": 1}, count=1)
        assert item.pk == pk
        assert item.run_at <= dt.datetime.now(UTC) and not ScheduleTick.objects.exists()


# -- the admin ---------------------------------------------------------------------------


def staff(username, *codenames):
    user = User.objects.create_user(username, password="pw", is_staff=True)  # noqa: S106
    user.user_permissions.set(Permission.objects.filter(codename__in=codenames))
    return user


def act(client, action, rows):
    data = {"action": action, "_selected_action": [row.pk for row in rows]}
    return client.post(CHANGELIST, data, follow=True)


def form(**fields):
    return {
        "name": "nightly",
        "enabled": "on",
        "queue": "ops",
        "payload": "null",
        "priority": "0",
        "key": "",
        "task": "",
        "args": "[]",
        "kwargs": "{}",
        "cron": "",
        "every": "",
        "catch_up": "latest",
        **fields,
    }


@pytest.mark.django_db
class TestAdmin:
    def test_the_changelist_shows_rows_and_the_settings_entries(self, admin_client):
        entry_row(name="beat<b>", every=60)
        entry_row(name="off", cron="0 3 * * *", every=None, enabled=False)
        ScheduleTick.objects.create(name="beat<b>", tick=dt.datetime(2026, 11, 25, 10, tzinfo=UTC))
        with schedule(nightly={"QUEUE": "r", "CRON": "0 4 * * *"}):
            response = admin_client.get(CHANGELIST)
        content = response.content.decode()
        assert response.status_code == 200
        assert "beat&lt;b&gt;" in content and "beat<b>" not in content
        assert "every 60 s" in content and "cron 0 3 * * *" in content
        assert "Nov. 25, 2026" in content or "2026-11-25" in content
        assert "(disabled)" in content and "never" in content
        assert 'id="schedule-table"' in content and 'data-entry="nightly"' in content

    def test_the_dashboard_and_txqueue_schedule_list_the_enabled_rows_too(self, admin_client):
        entry_row(name="db-beat", every=60)
        entry_row(name="db-off", every=60, enabled=False)
        with schedule(nightly={"QUEUE": "r", "CRON": "0 4 * * *"}):
            page = admin_client.get(reverse("admin:django_txqueue_dashboard_changelist"))
            out = io.StringIO()
            call_command("txqueue_schedule", stdout=out)
        content = page.content.decode()
        assert 'data-entry="db-beat"' in content and 'data-entry="nightly"' in content
        assert 'data-entry="db-off"' not in content  # disabled: nothing runs it
        listed = [line.split()[0] for line in out.getvalue().splitlines()[1:]]
        assert listed == ["db-beat", "nightly"]

    def test_add_saves_a_good_entry(self, admin_client):
        response = admin_client.post(ADD, form(cron="0 3 * * *", payload='{"a": 1}'))
        assert response.status_code == 302
        row = Schedule.objects.get()
        assert (row.cron, row.payload, row.every) == ("0 3 * * *", {"a": 1}, None)

    @pytest.mark.parametrize(
        ("fields", "words"),
        [
            ({"cron": "0 25 * * *"}, "is not a cron expression"),
            ({"cron": "0 3 * * *", "every": "60"}, "one of them"),
            ({}, "one of them"),
            ({"every": "60", "payload": "{nope"}, "Enter a valid JSON"),
            (
                {"every": "60", "queue": "", "task": "tests.testapp.tasks.nothing"},
                "not a Django Task",
            ),
        ],
    )
    def test_add_with_a_bad_field_shows_why_and_saves_nothing(self, admin_client, fields, words):
        response = admin_client.post(ADD, form(**fields))
        assert response.status_code == 200
        assert words in response.content.decode()
        assert not Schedule.objects.exists()

    def test_run_now_enable_and_disable(self, admin_client):
        row = entry_row(every=3600, enabled=False)
        response = act(admin_client, "run_now", [row])
        item = Queue("ops").items.get()
        assert f"Beat: enqueued item {item.pk}." in response.content.decode()
        act(admin_client, "enable", [row])
        assert Schedule.objects.get().enabled
        act(admin_client, "disable", [row])
        assert not Schedule.objects.get().enabled

    def test_a_view_only_user_sees_but_cannot_run_or_edit(self, client):
        row = entry_row(every=3600)
        client.force_login(staff("viewer", "view_schedule"))
        assert client.get(CHANGELIST).status_code == 200
        for action in ("run_now", "disable"):
            act(client, action, [row])
        assert not Queue("ops").items.exists() and Schedule.objects.get().enabled
        change = reverse("admin:django_txqueue_schedule_change", args=[row.pk])
        client.post(change, form(name="beat", every="1"))
        assert Schedule.objects.get().every == 3600
