"""A running consumer survives a restart of its database server (docs/reliability.md).

Each vendor gets a throwaway server of its own (``servers.py``): never the shared ones.
The consumer is a real ``run_queue_consumer`` process; everything else talks to the
throwaway server through subprocesses or the raw driver, so no test here uses
pytest-django's ``db`` fixture.

The tests of a vendor run in the suite run of that vendor (``TXQUEUE_TEST_DB=postgresql``
or ``mysql``), so that CI's passes do not repeat them. A machine without the server
binaries skips them, except under ``CI=true``, where that is a failure.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import has

from .servers import (
    DBNAME,
    DONE,
    FAILED,
    FAST,
    READY,
    ROOT,
    Server,
    child_env,
    counts,
    django,
    enqueue,
    wait_for,
)

ITEMS = 100
SECONDS_EACH = 0.05  # ITEMS * SECONDS_EACH: about 5 s of work, so the outage hits mid-run
DOWN = 2.0  # seconds the server stays down
RETRY_LINE = re.compile(r"database error, retrying in ([\d.]+) s")
LOGGED_RETRY = re.compile(r"^(\S+ \S+) WARNING database error, retrying in ([\d.]+) s", re.M)

pytestmark = pytest.mark.slow


@pytest.fixture
def fresh(server):
    """Empty queue, run and consumer tables."""
    for table in ("django_txqueue_queueitem", "django_txqueue_consumer", "testapp_run"):
        server.query(DBNAME, f"DELETE FROM {table}")
    return server


class Consumer:
    """A ``run_queue_consumer -v 2`` process; its log (stderr) goes to a file."""

    def __init__(self, server: Server, tmp_path: Path, *args: str, settings=None) -> None:
        self.log = tmp_path / "consumer.log"
        with open(self.log, "wb") as stderr, open(tmp_path / "consumer.out", "wb") as stdout:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "django", "run_queue_consumer", *args, "-v", "2"],
                env=child_env(server, settings),
                cwd=ROOT,
                stdout=stdout,
                stderr=stderr,
            )

    def output(self) -> str:
        return self.log.read_text()

    def assert_alive(self) -> None:
        assert self.process.poll() is None, f"the consumer died:\n{self.output()}"

    def terminate(self) -> int:
        """SIGTERM, as a deployment would; the exit code."""
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=30)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


@contextlib.contextmanager
def consumer(server: Server, tmp_path: Path, *args: str, settings=None):
    running = Consumer(server, tmp_path, *args, settings=settings)
    try:
        yield running
    finally:
        running.kill()


def back_off_over(output: str) -> bool:
    """Past the end of the last back-off pause logged (its jitter is at most +20%).

    Called once the server is back: had the attempt after that pause failed, its own
    line would be in the log by now.
    """
    found = LOGGED_RETRY.findall(output)
    if not found:
        return True
    logged, seconds = found[-1]
    # The consumer logs local time, and Django's TIME_ZONE ("UTC") set its local time.
    at = dt.datetime.strptime(logged, "%Y-%m-%d %H:%M:%S,%f").replace(tzinfo=dt.UTC)
    return time.time() > at.timestamp() + 1.2 * float(seconds) + 0.3


def assert_backed_off(output: str, outage: float) -> None:
    """It saw the outage, said so, and backed off instead of spinning."""
    retries = [float(seconds) for seconds in RETRY_LINE.findall(output)]
    assert retries, f"no database error logged:\n{output}"
    assert retries == sorted(retries), f"the back-off did not grow: {retries}"
    # Doubling from 0.5 s (with +-20% jitter), an outage of T seconds takes about
    # log2(T / 0.5) + 2 attempts; a busy loop would log hundreds.
    assert len(retries) <= 8, f"{len(retries)} retries in a {outage:.1f} s outage:\n{output}"
    # The heartbeat thread retries at its own interval, no faster.
    heartbeats = output.count("heartbeat failed")
    assert heartbeats <= (outage + 5) / FAST["HEARTBEAT_INTERVAL"], output


def assert_stopped_cleanly(server: Server, running: Consumer) -> None:
    code = running.terminate()
    output = running.output()
    assert code == 0, output
    assert "stopped" in output.splitlines()[-1], output
    stopped = server.query(DBNAME, "SELECT stopped_at FROM django_txqueue_consumer")
    assert len(stopped) == 1 and stopped[0][0] is not None, stopped


def item_ids(server: Server, sql: str) -> set[int]:
    return {int(row[0]) for row in server.query(DBNAME, sql)}


@pytest.mark.parametrize("concurrency", [1, 4])
def test_busy_consumer_survives_database_restart(fresh, tmp_path, concurrency):
    """Results the consumer could not acknowledge during the outage are kept and
    acknowledged under their own claim once the server is back: no item runs twice.

    Leases and the consumer timeout are far longer than the test, so no rescue can happen:
    a re-run could then only come from the consumer losing a result it had.
    """
    server = fresh
    settings = {**FAST, "LEASE": 600, "CONSUMER_TIMEOUT": 600}
    enqueue(server, "slow", f"[{{'seconds': {SECONDS_EACH}}}] * {ITEMS}")
    assert counts(server, "slow") == {READY: ITEMS}

    with consumer(
        server, tmp_path, "slow", "--concurrency", str(concurrency), settings=settings
    ) as running:
        wait_for(
            lambda: counts(server, "slow").get(DONE, 0) >= 10, 30, "the first items DONE", running
        )
        done_before = counts(server, "slow").get(DONE, 0)
        assert done_before < ITEMS, "the queue drained before the outage: nothing was tested"

        # Items whose handler had started (its Run row is written first) before the outage,
        # and of those the ones not yet acknowledged: still in a handler or awaiting the ack.
        started = item_ids(server, "SELECT item_id FROM testapp_run")
        done_then = item_ids(
            server, f"SELECT id FROM django_txqueue_queueitem WHERE status = {DONE}"
        )
        went_down = time.monotonic()
        server.restart(down=DOWN)
        outage = time.monotonic() - went_down
        running.assert_alive()

        wait_for(
            lambda: (
                counts(server, "slow").get(DONE, 0) == ITEMS or counts(server, "slow").get(FAILED)
            ),
            60,
            f"all {ITEMS} items DONE",
            running,
        )
        running.assert_alive()
        final = counts(server, "slow")
        assert final == {DONE: ITEMS}, f"{final}\n{running.output()}"  # none IN_PROGRESS
        assert_stopped_cleanly(server, running)

    output = running.output()
    assert_backed_off(output, outage)
    runs = {
        int(pk): int(n)
        for pk, n in server.query(
            DBNAME, "SELECT item_id, COUNT(*) FROM testapp_run GROUP BY item_id"
        )
    }
    items = {
        int(pk): (int(attempts), server.decode_json(result), last_error)
        for pk, attempts, result, last_error in server.query(
            DBNAME,
            "SELECT id, attempts, result, last_error FROM django_txqueue_queueitem "
            "WHERE queue = %s",
            ("slow",),
        )
    }
    assert len(items) == ITEMS and set(runs) == set(items), output  # none lost
    assert {result for _, result, _ in items.values()} == {"slept"}
    # No check that no acknowledgement was refused: one whose COMMIT landed as the server went
    # down is sent again and refused (its row is DONE already; seen once in CI, under load).
    # Harmless, and what matters is held below: each item ran once, on its first claim.
    # Each item whose handler had started before the outage (acknowledged by then or not:
    # `unacknowledged` were in a handler or awaiting their acknowledgement) ran once and
    # was acknowledged on its first claim: its result was kept through the outage.
    unacknowledged = started - done_then
    for pk in sorted(started):
        assert (pk, *items[pk], runs[pk]) == (pk, 1, "slept", "", 1), (unacknowledged, output)
    # Every other item ran once too, on one attempt, unless its handler itself hit the
    # outage: its Run insert failed on the lost connection, the database's failure, so the
    # item was released (logged, no attempt counted) and ran again (had the insert
    # committed just as the connection dropped, it has two runs). A rescue or a lost result
    # would leave two runs with no such line.
    for pk, (attempts, _, last_error) in items.items():
        released = f"slow #{pk}: the database failed, not the handler" in output
        assert attempts == 1 and last_error == "", (pk, attempts, last_error)
        assert runs[pk] == 1 or (released and runs[pk] == 2), (pk, runs[pk], output)


def test_idle_consumer_survives_database_restart_and_wakes_up_again(fresh, tmp_path):
    """Idle through the restart, the consumer gets its wake-ups back (LISTEN on PostgreSQL).

    With a long POLL_INTERVAL, an item enqueued after the restart is handled at once only
    if a wake-up reaches the consumer: its idle wait has grown to seconds by then.
    """
    server = fresh
    notify = has("notify")  # the throwaway server is of this run's kind (``server``)
    settings = {**FAST, "POLL_INTERVAL": 30}
    with consumer(server, tmp_path, "echo", settings=settings) as running:
        enqueue(server, "echo", "[{'n': 1}]")
        wait_for(lambda: counts(server, "echo") == {DONE: 1}, 30, "the first item DONE", running)
        time.sleep(3)  # idle: the wait between polls grows past 3 s

        went_down = time.monotonic()
        server.restart(down=DOWN)
        outage = time.monotonic() - went_down
        running.assert_alive()

        # Back: heartbeating again, and on PostgreSQL LISTENing on a new connection.
        wait_for(
            lambda: server.query(
                DBNAME,
                "SELECT COUNT(*) FROM django_txqueue_consumer "
                "WHERE last_heartbeat_at > started_at",
            )[0][0],
            30,
            "a heartbeat after the restart",
            running,
        )
        if notify:
            wait_for(
                lambda: server.query(
                    "postgres",
                    "SELECT COUNT(*) FROM pg_stat_activity WHERE query LIKE %s",
                    ("LISTEN %",),
                )[0][0],
                30,
                "the consumer to LISTEN again",
                running,
            )
        # Its loop is out of the back-off pause, idle again, not still sleeping it off.
        wait_for(lambda: back_off_over(running.output()), 60, "the back-off to end", running)
        enqueue(server, "echo", "[{'n': 2}]")
        enqueued = time.monotonic()
        wait_for(lambda: counts(server, "echo") == {DONE: 2}, 30, "the second item DONE", running)
        latency = time.monotonic() - enqueued
        running.assert_alive()
        assert latency < 1.5, f"woken after {latency:.1f} s: polled, not woken\n{running.output()}"
        assert_stopped_cleanly(server, running)

    output = running.output()
    assert_backed_off(output, outage)
    if notify:
        assert output.count("lost the LISTEN connection") == 1, output
        assert output.count("LISTEN failed") <= 2, output


@pytest.mark.slow
def test_txqueue_chaos_with_a_server_restart_each_round_finds_nothing_wrong(fresh):
    """``txqueue_chaos --restart-command``: a kill, a SIGTERM and a restart of the server
    in each round, then the audit finds no violation."""
    out = django(
        fresh, "txqueue_chaos", "--yes", "--json", "--items", "400", "--consumers", "3",
        "--rounds", "2", "--restart-command", fresh.restart_command(),
    )  # fmt: skip
    report = json.loads(out)
    assert report["violations"] == []
    assert report["restarts"] == 2 and report["kills"] == 2
    assert report["items"] == 400
