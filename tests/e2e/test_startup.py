"""A consumer started while its database is down waits for it.

A server restart, a failover or a container that comes up before its database: the
consumer must not exit 1 with a traceback (a crash loop under systemd or ``--processes``)
but wait with the loop's growing, jittered pauses, one log line per failed try, start as
soon as the database is back, and exit 0 on SIGTERM while it waits.

The throwaway servers of conftest.py's ``server`` fixture (as in test_database_restart.py:
one per vendor, run only in that vendor's pass, a failure instead of a skip under
``CI=true``) are stopped before the consumer starts. SQLite cannot be "down", but a
database file it cannot open (a volume not mounted yet) failed the same way: its test
runs in the SQLite pass.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT, kill_tree

from .servers import DBNAME, DONE, FAST, child_env, counts, enqueue, run_django, wait_for

pytestmark = pytest.mark.slow

ITEMS = 20
LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")
WAITING = re.compile(
    r"^(\S+ \S+) WARNING database 'default' unavailable at start-up, retrying in ([\d.]+) s: \S",
    re.M,
)
STARTED = re.compile(r"^(\S+ \S+) INFO consumer \S+ started", re.M)
AVAILABLE = re.compile(r"^(\S+ \S+) INFO database 'default' is available", re.M)


def logged_at(stamp: str) -> float:
    """The consumer logs local time, and Django's TIME_ZONE ("UTC") set its local time."""
    at = dt.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").replace(tzinfo=dt.UTC)
    return at.timestamp()


class Consumer:
    """``run_queue_consumer ARGS -v 2`` in its own session; its log (stderr) in a file."""

    def __init__(self, env: dict[str, str], tmp_path: Path, *args: str) -> None:
        self.log = tmp_path / "consumer.log"
        with open(self.log, "wb") as stderr, open(tmp_path / "consumer.out", "wb") as stdout:
            self.process = subprocess.Popen(  # noqa: S603 - our own command line
                [sys.executable, "-m", "django", "run_queue_consumer", *args, "-v", "2"],
                env=env,
                cwd=ROOT,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,  # as in test_consumer_processes.py
            )

    def output(self) -> str:
        return self.log.read_text()

    def assert_alive(self) -> None:
        assert self.process.poll() is None, f"the consumer died:\n{self.output()}"

    def tries(self) -> list[tuple[float, float]]:
        """(logged at, pause announced) of each failed try to reach the database."""
        return [(logged_at(at), float(pause)) for at, pause in WAITING.findall(self.output())]

    def kill(self) -> None:
        """The consumer, or the supervisor and its children (each in a session of its own)."""
        kill_tree(self.process)


@pytest.fixture
def start(tmp_path):
    started: list[Consumer] = []

    def start(env: dict[str, str], *args: str) -> Consumer:
        started.append(Consumer(env, tmp_path, *args))
        return started[-1]

    yield start
    for running in started:
        running.kill()


@pytest.fixture
def fresh(server):
    """The throwaway server with empty tables; up again afterwards, for the next test."""
    for table in ("django_txqueue_queueitem", "django_txqueue_consumer", "testapp_run"):
        server.query(DBNAME, f"DELETE FROM {table}")
    yield server
    try:
        server.connect().close()
    except Exception:  # still down: the next test needs it up
        server.start()


def assert_waited(running: Consumer, least: int) -> list[tuple[float, float]]:
    """At least ``least`` failed tries, each one log line, with growing, real pauses."""
    tries = running.tries()
    output = running.output()
    assert len(tries) >= least, output
    assert "Traceback" not in output, output
    # One line per try: every stderr line is a log record (PostgreSQL's errors span two).
    assert all(LINE.match(line) for line in output.splitlines()), output
    pauses = [pause for _, pause in tries]
    assert pauses == [min(0.5 * 2**n, 30.0) for n in range(len(pauses))], output
    for (at, pause), (next_at, _) in zip(tries, tries[1:], strict=False):
        # Jitter is +-20%; the next try's own connection attempt only adds to the gap.
        assert next_at - at >= 0.8 * pause - 0.01, f"a {pause} s pause took {next_at - at}"
    return tries


def wait_for_tries(running: Consumer, n: int) -> None:
    wait_for(lambda: len(running.tries()) >= n, 30, f"{n} failed tries logged", running)


def assert_drained_after_waiting(running: Consumer, up: float) -> str:
    """A --burst consumer that waited (three tries at least), started promptly once the
    database was back at ``up``, and exited 0. Returns its log."""
    code = running.process.wait(timeout=30)
    output = running.output()
    assert code == 0, output
    tries = assert_waited(running, 3)
    assert_started_promptly(running, tries, up)
    return output


def assert_started_promptly(
    running: Consumer, tries: list[tuple[float, float]], up: float
) -> None:
    """Found the database at the first try after it was back (``up``), not a pause later,
    then started its consumers."""
    output = running.output()
    assert STARTED.findall(output), output
    available = AVAILABLE.findall(output)
    assert len(available) == 1, output
    last_at, last_pause = tries[-1]
    # That try came at the end of the last pause announced (jitter +-20%), or at once if the
    # database came back later; then its checks, well within a second. How long consumers
    # take to start after that (Django's start-up in each --processes child: seconds on a
    # loaded machine) is not what this checks.
    assert logged_at(available[0]) <= max(up, last_at + 1.2 * last_pause) + 1.0, output


@pytest.mark.parametrize("concurrency", [1, 4])
def test_burst_consumer_started_while_database_down_waits_then_drains(fresh, start, concurrency):
    server = fresh
    enqueue(server, "echo", f"[{{'n': n}} for n in range({ITEMS})]")  # items wait...
    server.stop()  # ...for a database that restarts
    running = start(child_env(server), "echo", "--burst", "--concurrency", str(concurrency))
    wait_for_tries(running, 3)  # pauses 0.5, 1 and 2 s: it is waiting, not dead
    running.assert_alive()
    server.start()
    up = time.time()
    output = assert_drained_after_waiting(running, up)
    assert counts(server, "echo") == {DONE: ITEMS}, output
    assert "stopped" in output.splitlines()[-1], output


@pytest.mark.parametrize(
    "args, consumers",
    [(["--concurrency", "4"], 1), (["--processes", "2"], 2)],
    ids=["loop", "supervisor"],
)
def test_consumer_started_while_database_down_serves_items_enqueued_once_it_is_up(
    fresh, start, args, consumers
):
    """With ``--processes``, the supervisor waits (its checks need the database too)."""
    server = fresh
    server.stop()
    running = start(child_env(server), "echo", *args)
    wait_for_tries(running, 2)
    running.assert_alive()
    server.start()
    up = time.time()
    wait_for(
        lambda: len(STARTED.findall(running.output())) == consumers,
        30,
        f"{consumers} consumers to start",
        running,
    )
    enqueue(server, "echo", f"[{{'n': n}} for n in range({ITEMS})]")
    wait_for(lambda: counts(server, "echo") == {DONE: ITEMS}, 30, "every item DONE", running)
    tries = assert_waited(running, 2)
    assert_started_promptly(running, tries, up)
    running.process.send_signal(signal.SIGTERM)
    assert running.process.wait(timeout=30) == 0, running.output()
    stopped = server.query(DBNAME, "SELECT stopped_at FROM django_txqueue_consumer")
    assert len(stopped) == consumers, stopped
    assert all(at is not None for (at,) in stopped), stopped


@pytest.mark.parametrize(
    "args", [[], ["--burst"], ["--processes", "2"]], ids=["loop", "burst", "supervisor"]
)
def test_sigterm_while_waiting_for_database_exits_0_at_once(fresh, start, args):
    server = fresh
    server.stop()
    running = start(child_env(server), "echo", *args)
    wait_for_tries(running, 2)  # in a pause of about 1 s
    running.process.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    code = running.process.wait(timeout=10)
    took = time.monotonic() - sent
    output = running.output()
    assert code == 0, output
    assert took < 2.0, f"exited {took:.1f} s after SIGTERM\n{output}"
    assert "Traceback" not in output, output
    server.start()
    # It never got as far as registering, and left nothing behind.
    assert server.query(DBNAME, "SELECT COUNT(*) FROM django_txqueue_consumer")[0][0] == 0
    assert counts(server, "echo") == {}


def test_a_burst_run_gives_up_on_a_database_that_does_not_answer(fresh, start):
    """A cron or CI drain must end: past --burst-wait, exit 1 with a line that says why."""
    server = fresh
    server.stop()
    began = time.monotonic()
    running = start(child_env(server), "echo", "--burst", "--burst-wait", "2")
    code = running.process.wait(timeout=30)
    output = running.output()
    assert code == 1, output
    assert time.monotonic() - began < 15, output
    assert "did not answer for 2 s (--burst-wait): a --burst run gives up" in output, output


def test_a_burst_run_gives_up_on_a_database_lost_midway(fresh, start):
    server = fresh
    enqueue(server, "slow", f"[{{'seconds': 0.2}} for n in range({ITEMS})]")
    running = start(child_env(server), "slow", "--burst", "--burst-wait", "2")
    wait_for(lambda: counts(server, "slow").get(DONE, 0) >= 2, 30, "a few items DONE", running)
    server.stop()
    code = running.process.wait(timeout=60)
    output = running.output()
    assert code == 1, output
    assert "has not answered for" in output and "this --burst run gives up" in output, output


# -- SQLite: a database file that cannot be opened yet ------------------------------------


def sqlite_env(path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TXQUEUE_")}
    env.update(
        DJANGO_SETTINGS_MODULE="tests.settings",
        PYTHONPATH=str(ROOT),
        PYTHONUNBUFFERED="1",
        TXQUEUE_TEST_DB="sqlite",
        TXQUEUE_TEST_NAME=str(path),
        TXQUEUE_TEST_SETTINGS=json.dumps(FAST),
    )
    return env


def sqlite_django(path: Path, *args: str) -> None:
    run_django(sqlite_env(path), *args)


def test_sqlite_consumer_waits_for_its_database_file(tmp_path, start):
    """The file's directory appears later (a volume mounted after the container started)."""
    current = os.environ.get("TXQUEUE_TEST_DB", "sqlite")
    if current != "sqlite":
        pytest.skip(f"runs with TXQUEUE_TEST_DB=sqlite (this run: {current})")
    ready, mounted = tmp_path / "ready", tmp_path / "mounted"
    ready.mkdir()
    sqlite_django(ready / "db.sqlite3", "migrate", "--noinput", "-v", "0")
    sqlite_django(
        ready / "db.sqlite3",
        "shell",
        "-c",
        f"from django_txqueue import enqueue_many; enqueue_many('echo', [1] * {ITEMS})",
    )
    running = start(sqlite_env(mounted / "db.sqlite3"), "echo", "--burst")
    wait_for_tries(running, 3)
    running.assert_alive()
    ready.rename(mounted)  # the whole database appears at once
    up = time.time()
    output = assert_drained_after_waiting(running, up)
    with contextlib.closing(sqlite3.connect(mounted / "db.sqlite3")) as connection:
        rows = connection.execute(
            "SELECT status, COUNT(*) FROM django_txqueue_queueitem GROUP BY status"
        ).fetchall()
    assert rows == [(DONE, ITEMS)], output


def test_a_sqlite_burst_run_gives_up_on_a_file_that_never_appears(tmp_path, start):
    current = os.environ.get("TXQUEUE_TEST_DB", "sqlite")
    if current != "sqlite":
        pytest.skip(f"runs with TXQUEUE_TEST_DB=sqlite (this run: {current})")
    running = start(
        sqlite_env(tmp_path / "never" / "db.sqlite3"), "echo", "--burst", "--burst-wait", "1"
    )
    code = running.process.wait(timeout=30)
    output = running.output()
    assert code == 1, output
    assert "did not answer for 1 s (--burst-wait): a --burst run gives up" in output, output
