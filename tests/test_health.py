"""``txqueue_health`` and the JSON health view: an exit status and one line for each
reason (a database that does not answer, this host's consumers silent, a queue's oldest
due item waiting too long), and the view's status codes."""

import datetime as dt
import io
import json
import os
import socket
import subprocess
import sys

import pytest
from django.core.management import call_command
from django.db import connections
from django.utils import timezone

from django_txqueue import Queue, enqueue
from django_txqueue.models import Consumer, QueueItem

from .helpers import ROOT, child_env

HOST = socket.gethostname()
BOTH = ["default", "other"]

pytestmark = pytest.mark.django_db(databases=BOTH, transaction=True)


def probe(*args):
    """``txqueue_health ARGS``: (exit status, stdout)."""
    out = io.StringIO()
    try:
        call_command("txqueue_health", *args, stdout=out, no_color=True)
    except SystemExit as exit:
        return exit.code, out.getvalue()
    return 0, out.getvalue()


def one_line(output):
    lines = output.splitlines()
    assert len(lines) == 1, output
    return lines[0]


def consumer(*, pid=None, silent_for=0.0, host=HOST, stopped=False, started_ago=0.0):
    now = timezone.now()
    return Consumer.objects.create(
        identity=f"{host}:{pid}:{Consumer.objects.count()}",
        host=host,
        os_pid=os.getpid() if pid is None else pid,
        last_heartbeat_at=now - dt.timedelta(seconds=silent_for),
        started_at=now - dt.timedelta(seconds=started_ago),
        stopped_at=now if stopped else None,
    )


def dead_pid():
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def waiting(queue, seconds):
    """An item of ``queue`` due ``seconds`` ago."""
    return enqueue(queue, {"n": 1}, run_at=timezone.now() - dt.timedelta(seconds=seconds))


@pytest.fixture
def closed_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def other_unreachable(settings, closed_port):
    """A queue placed on "other", and "other" pointed where nothing answers: a closed
    port on the loopback (a SQLite file in a directory that does not exist)."""
    settings.TXQUEUE = {**settings.TXQUEUE, "QUEUES": {"elsewhere": {"DATABASE": "other"}}}
    other = connections["other"]
    saved = dict(other.settings_dict)
    other.close()
    if other.vendor == "sqlite":
        other.settings_dict["NAME"] = "/nonexistent-txqueue-dir/db.sqlite3"
    else:
        other.settings_dict.update(HOST="127.0.0.1", PORT=str(closed_port))
    yield
    other.close()
    other.settings_dict.clear()
    other.settings_dict.update(saved)


class TestDatabase:
    def test_healthy_by_default(self):
        assert probe() == (0, "ok: database 'default' reachable\n")

    def test_every_database_the_settings_place_queues_on(self, settings):
        settings.TXQUEUE = {**settings.TXQUEUE, "QUEUES": {"elsewhere": {"DATABASE": "other"}}}
        status, output = probe()
        assert status == 0
        assert one_line(output) == "ok: database 'default' reachable; database 'other' reachable"

    def test_an_unreachable_database_is_named_with_the_drivers_reason(self, other_unreachable):
        status, output = probe()
        line = one_line(output)
        assert status == 1
        assert line.startswith("unhealthy: database 'other' unreachable: "), line
        assert "'default'" not in line  # only the failing check says anything

    def test_the_other_checks_are_not_run_against_a_database_that_is_down(self, other_unreachable):
        status, output = probe("--max-heartbeat-age", "30", "--max-ready-age", "60")
        assert status == 1
        assert one_line(output).startswith("unhealthy: database 'other' unreachable")

    def test_database_picks_one(self, other_unreachable):
        assert probe("--database", "default") == (0, "ok: database 'default' reachable\n")

    def test_an_unknown_alias_is_an_error(self):
        with pytest.raises(Exception, match="Unknown database alias 'nope'"):
            probe("--database", "nope")


class TestHeartbeat:
    def test_a_beating_consumer_is_healthy(self):
        consumer(silent_for=2)
        status, output = probe("--max-heartbeat-age", "30")
        assert status == 0
        line = one_line(output)
        assert line.startswith("ok: database 'default' reachable; 1 consumer on host ")
        assert f"host {HOST} heartbeating (oldest " in line

    def test_a_silent_consumer_is_unhealthy(self):
        consumer(silent_for=2)
        consumer(silent_for=120, pid=os.getppid())
        status, output = probe("--max-heartbeat-age", "30")
        assert status == 1
        line = one_line(output)
        assert line.startswith(f"unhealthy: 1 of 2 consumers on host {HOST} silent for 12"), line
        assert line.endswith(" s (over 30 s)")

    def test_no_consumer_on_this_host_is_unhealthy(self):
        consumer(host="elsewhere.example")
        consumer(stopped=True)
        assert probe("--max-heartbeat-age", "30") == (
            1,
            f"unhealthy: no consumer running on host {HOST}\n",
        )

    def test_rows_of_processes_gone_are_left_out(self):
        """A consumer killed (SIGKILL, OOM) never marks its row stopped: its silence
        must not fail the probe of the one that replaced it."""
        consumer(silent_for=3600, pid=dead_pid())
        consumer(silent_for=1)
        assert probe("--max-heartbeat-age", "30")[0] == 0

    def test_a_pid_reused_counts_its_latest_row_only(self):
        """A container restarted in place runs its consumer as pid 1 again."""
        consumer(silent_for=3600, started_ago=7200)
        consumer(silent_for=1, started_ago=10)
        status, output = probe("--max-heartbeat-age", "30")
        assert status == 0
        assert "1 consumer on host" in output

    def test_consumer_pid_checks_that_process_only(self):
        consumer(silent_for=1)
        consumer(silent_for=120, pid=os.getppid())
        assert probe("--max-heartbeat-age", "30", "--consumer-pid", str(os.getpid()))[0] == 0
        status, output = probe("--max-heartbeat-age", "30", "--consumer-pid", str(os.getppid()))
        assert status == 1
        assert f"1 of 1 consumer on pid {os.getppid()} silent for" in one_line(output)
        status, output = probe("--max-heartbeat-age", "30", "--consumer-pid", str(dead_pid()))
        assert (status, output.startswith("unhealthy: no consumer running on pid ")) == (1, True)

    def test_any_host_wants_one_consumer_anywhere(self):
        consumer(host="worker-1.example", pid=dead_pid(), silent_for=1)
        assert probe("--max-heartbeat-age", "30", "--any-host")[0] == 0
        Consumer.objects.update(last_heartbeat_at=timezone.now() - dt.timedelta(minutes=5))
        assert probe("--max-heartbeat-age", "30", "--any-host") == (
            1,
            "unhealthy: no consumer heartbeat within 30 s\n",
        )

    def test_consumer_pid_needs_max_heartbeat_age(self):
        with pytest.raises(Exception, match="need --max-heartbeat-age"):
            probe("--consumer-pid", "1")


class TestReadyAge:
    def test_a_queue_within_the_threshold_is_healthy(self):
        waiting("sms", 5)
        enqueue("sms", {"n": 2}, delay=3600)  # not due: not waiting
        status, output = probe("--max-ready-age", "60")
        assert status == 0
        assert one_line(output).startswith("ok: database 'default' reachable; oldest due item ")
        assert "('sms', at most 60 s)" in output

    def test_an_item_waiting_too_long_is_unhealthy(self):
        waiting("sms", 5)
        waiting("emails", 600)
        status, output = probe("--max-ready-age", "60")
        assert status == 1
        line = one_line(output)
        assert line.startswith("unhealthy: queue 'emails': oldest due item waiting 60"), line
        assert line.endswith(" s (over 60 s)")

    def test_queue_limits_the_check(self):
        waiting("emails", 600)
        waiting("sms", 5)
        assert probe("--max-ready-age", "60", "--queue", "sms")[0] == 0
        assert probe("--max-ready-age", "60", "--queue", "emails")[0] == 1

    def test_a_queue_on_another_database_is_read_there(self, settings):
        settings.TXQUEUE = {**settings.TXQUEUE, "QUEUES": {"elsewhere": {"DATABASE": "other"}}}
        waiting("elsewhere", 600)
        assert QueueItem.objects.using("other").count() == 1
        status, output = probe("--max-ready-age", "60", "--queue", "elsewhere")
        assert status == 1
        assert "queue 'elsewhere': oldest due item waiting" in output
        assert probe("--max-ready-age", "60")[0] == 1  # every queue, every database

    def test_a_paused_queue_is_left_out(self):
        waiting("emails", 600)
        Queue("emails").pause()
        assert probe("--max-ready-age", "60") == (
            0,
            "ok: database 'default' reachable; no due items waiting\n",
        )

    def test_claimed_items_do_not_count(self):
        waiting("emails", 600)
        assert len(Queue("emails").claim()) == 1
        assert probe("--max-ready-age", "60")[0] == 0

    def test_several_reasons_share_the_line(self):
        waiting("emails", 600)
        status, output = probe("--max-ready-age", "60", "--max-heartbeat-age", "30")
        assert status == 1
        assert one_line(output) == (
            f"unhealthy: no consumer running on host {HOST}; queue 'emails': oldest due item "
            + output.split("oldest due item ")[1].strip()
        )


class TestJson:
    def test_json_is_the_views_body(self):
        waiting("emails", 600)
        status, output = probe("--max-ready-age", "60", "--json")
        body = json.loads(output)
        assert status == 1 and body["healthy"] is False
        assert [check["name"] for check in body["checks"]] == ["database", "ready_age"]
        assert body["checks"][1]["counts"]["late"] == 1


class TestView:
    URL = "/txqueue/health/"

    def test_healthy_is_200_without_logging_in(self, client):
        consumer(host="worker-1.example", pid=dead_pid(), silent_for=1)
        response = client.get(self.URL, {"max_heartbeat_age": 30, "max_ready_age": 60})
        assert response.status_code == 200
        body = response.json()
        assert body["healthy"] is True
        names = [check["name"] for check in body["checks"]]
        assert names == ["database", "heartbeat", "ready_age"]
        assert all(check["healthy"] for check in body["checks"])
        assert body["checks"][1]["counts"] == {"consumers": 1}
        assert "no-cache" in response["Cache-Control"]

    def test_a_late_queue_is_503_with_the_reason(self, client):
        item = waiting("emails", 600)
        response = client.get(self.URL, {"max_ready_age": 60, "queue": "emails"})
        assert response.status_code == 503
        body = response.json()
        assert body["healthy"] is False
        assert body["summary"].startswith("unhealthy: queue 'emails': oldest due item waiting")
        assert json.dumps(item.payload) not in response.content.decode()

    def test_no_live_consumer_is_503(self, client):
        response = client.get(self.URL, {"max_heartbeat_age": 30})
        assert response.status_code == 503
        assert response.json()["summary"] == "unhealthy: no consumer heartbeat within 30 s"

    def test_an_unreachable_database_is_503_without_the_drivers_message(
        self, client, other_unreachable
    ):
        response = client.get(self.URL)
        assert response.status_code == 503
        assert response.json()["summary"] == "unhealthy: database 'other' unreachable"

    def test_a_bad_threshold_is_400(self, client):
        assert client.get(self.URL, {"max_ready_age": "soon"}).status_code == 400
        assert client.get(self.URL, {"max_ready_age": "-1"}).status_code == 400

    def test_only_get(self, client):
        assert client.post(self.URL).status_code == 405


def test_the_command_exits_1_with_one_line_in_its_own_process():
    """What a kubelet or systemd sees: the process's exit status and its output."""
    waiting("emails", 600)
    command = [sys.executable, "-m", "django", "txqueue_health", "--max-ready-age", "60"]
    done = subprocess.run(
        command, env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1, done.stderr
    assert one_line(done.stdout).startswith("unhealthy: queue 'emails': oldest due item")
    assert done.stderr == ""
