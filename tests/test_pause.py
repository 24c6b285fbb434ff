"""Pausing and resuming a queue: the API, the claim statement, consumers, the commands and
the dashboard's buttons, on every database."""

import io
import time

import pytest
from django.contrib.auth.models import Permission, User
from django.core.management import CommandError, call_command
from django.test import Client
from django.urls import reverse

from django_txqueue import Queue, Status
from django_txqueue.models import QueuePause
from tests.helpers import running, runs_per_item, wait_for, worker_for

pytestmark = pytest.mark.django_db(transaction=True)

DASHBOARD = "admin:django_txqueue_dashboard_changelist"
PAUSE = "admin:django_txqueue_dashboard_pause"


def test_pause_and_resume_say_whether_they_changed_anything(queue):
    assert not queue.is_paused()
    assert queue.pause() is True
    assert queue.pause() is False  # already paused
    assert queue.is_paused()
    assert Queue(queue.name).is_paused()  # held in the database, not in the instance
    assert not Queue(queue.name + "x").is_paused()
    assert queue.resume() is True
    assert queue.resume() is False
    assert not queue.is_paused()
    assert not QueuePause.objects.exists()


def test_a_paused_queue_takes_items_but_no_claim_takes_any(queue, strategy):
    queue.enqueue(1)
    queue.pause()
    second = queue.enqueue(2)  # enqueue goes on
    assert queue.claim(10, strategy=strategy) == []
    assert queue.peek() is None
    with queue.dequeue() as item:
        assert item is None
    assert queue.count() == 2
    assert queue.stats()["paused"] is True
    queue.resume()
    claimed = queue.claim(10, strategy=strategy)
    assert sorted(item.payload for item in claimed) == [1, 2]
    assert second.pk in {item.pk for item in claimed}
    assert queue.stats()["paused"] is False


def test_pausing_one_queue_leaves_the_others_alone(queue, strategy):
    other = Queue(queue.name + "-other")
    queue.enqueue(1)
    other.enqueue(2)
    queue.pause()
    assert [item.payload for item in other.claim(10, strategy=strategy)] == [2]


def test_items_in_flight_finish_after_a_pause(queue):
    queue.enqueue("x")
    [item] = queue.claim(1)
    queue.pause()
    assert item.ack("ok") is True
    item.refresh_from_db()
    assert item.status == Status.DONE


@pytest.mark.usefixtures("fast_consumers")
def test_a_running_consumer_stops_claiming_at_a_pause_and_drains_after_resume():
    echo = Queue("echo")
    first = [echo.enqueue(n).pk for n in range(5)]
    worker = worker_for("echo", batch=2)
    with running(worker):
        assert wait_for(lambda: echo.count(Status.DONE) == 5)
        echo.pause()
        later = [echo.enqueue(n).pk for n in range(5, 25)]
        time.sleep(0.5)  # several turns of the loop, five heartbeats
        assert echo.count(Status.READY) == 20, "a paused queue was claimed"
        echo.resume()
        assert wait_for(lambda: echo.count(Status.DONE) == 25)
    runs = runs_per_item()
    assert {pk: runs.get(pk) for pk in first + later} == dict.fromkeys(first + later, 1)


def test_a_burst_consumer_of_a_paused_queue_exits_at_once_claiming_nothing(run_consumer):
    echo = Queue("echo")
    for n in range(3):
        echo.enqueue(n)
    echo.pause()
    started = time.monotonic()
    run_consumer("echo", "--burst")
    assert time.monotonic() - started < 5
    assert echo.count(Status.READY) == 3
    assert runs_per_item() == {}
    echo.resume()
    run_consumer("echo", "--burst")
    assert echo.count(Status.DONE) == 3


def test_resume_wakes_a_waiting_consumer_at_once(settings, monkeypatch):
    """With polls 30 s apart from the first, only the resume's announcement (NOTIFY on
    PostgreSQL, a local datagram elsewhere) can bring the item in within seconds."""
    settings.TXQUEUE = {**settings.TXQUEUE, "POLL_INTERVAL": 30, "HEARTBEAT_INTERVAL": 30}
    monkeypatch.setattr("django_txqueue.consumer.worker.FIRST_IDLE_WAIT", 30)
    echo = Queue("echo")
    echo.pause()
    worker = worker_for("echo")
    with running(worker):
        echo.enqueue("waiting")  # wakes the worker: its claim finds the queue paused
        time.sleep(1.0)  # it claimed nothing and went back to its 30 s wait
        assert echo.count(Status.READY) == 1
        echo.resume()
        assert wait_for(lambda: echo.count(Status.DONE) == 1, timeout=5)


def test_the_commands_pause_and_resume(queue):
    out = io.StringIO()
    call_command("txqueue_pause", queue.name, stdout=out)
    call_command("txqueue_pause", queue.name, stdout=out)
    assert out.getvalue().splitlines() == [
        f"Paused queue '{queue.name}'.",
        f"Queue '{queue.name}' was paused already.",
    ]
    assert queue.is_paused()
    queue.enqueue(1)
    stats = io.StringIO()
    call_command("txqueue_stats", stdout=stats)
    assert f"Paused: {queue.name}" in stats.getvalue()
    out = io.StringIO()
    call_command("txqueue_resume", queue.name, stdout=out)
    call_command("txqueue_resume", queue.name, stdout=out)
    assert out.getvalue().splitlines() == [
        f"Resumed queue '{queue.name}'.",
        f"Queue '{queue.name}' was not paused.",
    ]
    assert not queue.is_paused()


def test_the_commands_name_what_is_wrong():
    with pytest.raises(CommandError, match="required: QUEUE"):
        call_command("txqueue_pause")
    with pytest.raises(CommandError, match="a queue name must be 1 to 100 characters"):
        call_command("txqueue_pause", "")
    with pytest.raises(CommandError, match="Unknown database alias 'nope'"):
        call_command("txqueue_resume", "q", "--database", "nope")
    assert not QueuePause.objects.exists()


# -- the dashboard's buttons --------------------------------------------------------


def user_with(*codenames):
    user = User.objects.create_user("u", is_staff=True)
    user.user_permissions.set(Permission.objects.filter(codename__in=codenames))
    return user


def test_the_dashboard_shows_pauses_and_a_button_to_users_who_may_change_items(queue):
    queue.enqueue(1)
    queue.pause()
    client = Client()
    client.force_login(user_with("change_queueitem"))
    page = client.get(reverse(DASHBOARD)).content.decode()
    row = page.split(f'data-queue="{queue.name}"')[1].split("</tr>")[0]
    assert "paused" in row
    assert 'value="resume"' in row
    assert 'value="pause"' not in row

    viewer = Client()
    viewer_user = User.objects.create_user("v", is_staff=True)
    viewer_user.user_permissions.set(Permission.objects.filter(codename="view_queueitem"))
    viewer.force_login(viewer_user)
    page = viewer.get(reverse(DASHBOARD)).content.decode()
    row = page.split(f'data-queue="{queue.name}"')[1].split("</tr>")[0]
    assert '<strong class="bad">paused</strong>' in row
    assert "txqueue-pause" not in page  # no form without the change permission


def test_the_buttons_pause_and_resume_with_the_change_permission_and_csrf(queue):
    queue.enqueue(1)
    client = Client(enforce_csrf_checks=True)
    client.force_login(user_with("change_queueitem"))
    page = client.get(reverse(DASHBOARD)).content.decode()
    row = page.split(f'data-queue="{queue.name}"')[1].split("</tr>")[0]
    token = row.split('name="csrfmiddlewaretoken" value="')[1].split('"')[0]

    data = {"queue": queue.name, "database": "", "action": "pause"}
    assert client.post(reverse(PAUSE), data).status_code == 403  # no token
    assert not queue.is_paused()
    response = client.post(reverse(PAUSE), {**data, "csrfmiddlewaretoken": token}, follow=True)
    assert queue.is_paused()
    assert f"Queue &#x27;{queue.name}&#x27; paused" in response.content.decode()
    client.post(reverse(PAUSE), {**data, "action": "resume", "csrfmiddlewaretoken": token})
    assert not queue.is_paused()


def test_the_buttons_refuse_users_who_may_only_view(queue):
    client = Client()
    client.force_login(user_with("view_queueitem"))
    data = {"queue": queue.name, "database": "", "action": "pause"}
    assert client.post(reverse(PAUSE), data).status_code == 403
    assert not queue.is_paused()


def test_a_bad_queue_name_from_the_form_is_said_not_stored():
    client = Client()
    client.force_login(user_with("change_queueitem"))
    data = {"queue": "", "database": "", "action": "pause"}
    page = client.post(reverse(PAUSE), data, follow=True).content.decode()
    assert "queue name must be 1 to 100 characters" in page
    assert not QueuePause.objects.exists()


def test_a_queue_name_is_escaped_in_the_dashboard_and_its_message():
    name = "<script>alert(1)</script>"
    Queue(name).enqueue(1)
    client = Client()
    client.force_login(user_with("change_queueitem"))
    data = {"queue": name, "database": "", "action": "pause"}
    page = client.post(reverse(PAUSE), data, follow=True).content.decode()
    assert Queue(name).is_paused()
    assert name not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
