"""Behind PgBouncer: a real ``/usr/sbin/pgbouncer`` in front of the
suite's PostgreSQL (``pgbouncer.py``), real ``run_queue_consumer`` processes and producers.

- A drain through ``pool_mode=transaction`` by three consumers: every item DONE once, the
  purge running and deleting through the pool, and no advisory lock left on the server
  after the consumers stop (a session lock leaked one per run before).
- Wake-ups: with ``LISTEN_DATABASES`` naming a direct alias, or with the consumer on a
  session pool, an idle consumer hears of new work in milliseconds, far under its poll
  interval, though producers commit through the transaction pool.
- LISTEN through the transaction pool itself: refused by the listener's probe with a
  WARNING naming ``LISTEN_DATABASES``, and the consumer polls (still draining).

PostgreSQL runs only (``TXQUEUE_TEST_DB=postgresql``); without pgbouncer they skip, except
under ``CI=true``, where that is a failure.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .pgbouncer import (
    DIRECT,
    SESSION,
    TRANSACTION,
    WARNED,
    PgBouncer,
    advisory_locks,
    create_database,
    drop_database,
    enqueue_one_by_one,
    query,
    registered,
    statuses,
    wake_up_delays,
)
from .servers import DONE, ROOT, needs_servers, run_django, wait_for

pytestmark = pytest.mark.slow

START_TIMEOUT = 20  # seconds for a consumer process to start
# Wake-ups: items enqueued GAP seconds apart. An idle consumer's waits between polls double
# from 0.05 s (worker.FIRST_IDLE_WAIT) up to POLL_INTERVAL: one that only polled would find
# each item 0.3-0.6 s late (0.05+0.1+0.2+0.4+0.8 s of waits span the gap); woken, in ms.
GAP = 1.0
SAMPLES = 6
WOKEN = 0.1  # the p50 delay, seconds, under which the consumer was woken, not polling
POLL = 5.0
LISTEN_DIRECT = {"LISTEN_DATABASES": {"default": "listen"}}


@pytest.fixture(scope="module")
def bouncer():
    """PgBouncer in front of a fresh, migrated database of the suite's server."""
    needs_servers("postgresql", PgBouncer.missing(), "the PgBouncer tests")
    name = f"txqueue_pgbouncer{os.environ.get('TXQUEUE_TEST_RUN', '')}"
    create_database(name)
    instance = PgBouncer(name)
    try:
        instance.start()
        run_django(instance.child_env(DIRECT), "migrate", "--noinput", "-v", "0")
        yield instance
    finally:
        instance.destroy()
        drop_database(name)


@pytest.fixture
def fresh(bouncer):
    for table in ("django_txqueue_queueitem", "django_txqueue_consumer", "testapp_run"):
        query(bouncer, f"DELETE FROM {table}")
    return bouncer


@pytest.fixture
def consumers(tmp_path):
    """Start ``run_queue_consumer`` processes; stopped by their own pids afterwards."""
    started: list[Consumer] = []

    def start(env: dict[str, str], *args: str) -> Consumer:
        running = Consumer(env, tmp_path / f"consumer{len(started)}.log", args)
        started.append(running)
        return running

    yield start
    for running in started:
        running.kill()


class Consumer:
    def __init__(self, env: dict[str, str], log: Path, args: tuple[str, ...]) -> None:
        self.log = log
        with open(log, "wb") as stderr:
            self.process = subprocess.Popen(  # noqa: S603 - our own command line
                [sys.executable, "-m", "django", "run_queue_consumer", *args, "-v", "2"],
                env=env,
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def assert_alive(self) -> None:
        assert self.process.poll() is None, f"the consumer died:\n{self.output()}"

    def stop(self) -> None:
        """SIGTERM, as a deployment would; it must exit 0."""
        self.process.send_signal(signal.SIGTERM)
        assert self.process.wait(timeout=30) == 0, self.output()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


def assert_wakes_up_quickly(bouncer: PgBouncer, env: dict[str, str], running: Consumer) -> None:
    """Items enqueued one at a time through the transaction pool wake an idle consumer."""
    enqueue_one_by_one(bouncer.child_env(TRANSACTION), "noop", SAMPLES, gap=GAP)
    wait_for(lambda: statuses(bouncer, "noop") == {DONE: SAMPLES}, 20, "the items done", running)
    delays = wake_up_delays(bouncer, "noop")
    assert statistics.median(delays) < WOKEN, f"delays {delays}\n{running.output()}"
    assert WARNED not in running.output()


def test_a_drain_through_a_transaction_pool(fresh, consumers):
    """Three consumers and the producer through pool_mode=transaction: every item DONE
    once, short-retention items purged through the pool, no lock left after."""
    bouncer, items, purged = fresh, 600, 60
    settings = {
        **LISTEN_DIRECT,
        "RETENTION": 3600,
        "PURGE_INTERVAL": 0.2,  # the purge lock taken and released five times a second
        "QUEUES": {"echo": {"RETENTION": 0.5}},
    }
    env = bouncer.child_env(TRANSACTION, {"listen": DIRECT}, settings)
    running = [
        consumers(env, "atomic", "echo", "--concurrency", "2", "--batch", "10") for _ in range(3)
    ]
    run_django(
        env,
        "shell",
        "-c",
        "from django_txqueue import enqueue_many\n"
        f"for _ in range({items // 100}):\n    enqueue_many('atomic', [{{}}] * 100)\n"
        f"enqueue_many('echo', list(range({purged})))",
    )

    def drained() -> bool:
        for consumer in running:
            consumer.assert_alive()
        return statuses(bouncer, "atomic") == {DONE: items} and not statuses(bouncer, "echo")

    wait_for(drained, 45, f"{items} items DONE and {purged} purged")
    runs = query(
        bouncer,
        "SELECT count(*), count(DISTINCT item_id), max(attempts), min(attempts) "
        "FROM testapp_run r LEFT JOIN django_txqueue_queueitem i ON i.id = r.item_id",
    )
    # The atomic handler's Run row commits with its acknowledgement; echo's are purged.
    assert runs == [(items + purged, items + purged, 1, 1)], runs
    for consumer in running:
        consumer.stop()
    assert advisory_locks(bouncer) == []
    for consumer in running:
        output = consumer.output()
        assert " WARNING " not in output and " ERROR " not in output, output


def test_wake_ups_with_listen_databases_direct(fresh, consumers):
    """Producer and consumer through the transaction pool, the LISTEN direct."""
    settings = {**LISTEN_DIRECT, "POLL_INTERVAL": POLL}
    env = fresh.child_env(TRANSACTION, {"listen": DIRECT}, settings)
    running = consumers(env, "noop")
    wait_for(lambda: registered(fresh, 1), START_TIMEOUT, "the consumer", running)
    time.sleep(0.5)  # its LISTEN opens on its first wait
    assert_wakes_up_quickly(fresh, env, running)
    running.stop()
    assert advisory_locks(fresh) == []


def test_a_consumer_on_a_session_pool(fresh, consumers):
    """The other supported shape: consumers through pool_mode=session, producers through
    the transaction pool; no setting needed."""
    env = fresh.child_env(SESSION, settings={"POLL_INTERVAL": POLL, "PURGE_INTERVAL": 0.2})
    running = consumers(env, "noop")
    wait_for(lambda: registered(fresh, 1), START_TIMEOUT, "the consumer", running)
    time.sleep(0.5)
    assert_wakes_up_quickly(fresh, env, running)
    running.stop()
    assert advisory_locks(fresh) == []


def test_listen_through_a_transaction_pool_is_refused_with_a_warning(fresh, consumers):
    """No LISTEN_DATABASES and the queue's alias on the transaction pool: the probe finds
    notifications lost, says so once, naming the setting, and the consumer polls (so
    its delays show what the wake-up tests above would measure without wake-ups)."""
    env = fresh.child_env(TRANSACTION, settings={"POLL_INTERVAL": POLL})
    running = consumers(env, "noop")
    wait_for(lambda: WARNED in running.output(), START_TIMEOUT, "the warning", running)
    enqueue_one_by_one(fresh.child_env(TRANSACTION), "noop", SAMPLES, gap=GAP)
    wait_for(lambda: statuses(fresh, "noop") == {DONE: SAMPLES}, 20, "the items polled", running)
    delays = wake_up_delays(fresh, "noop")
    assert statistics.median(delays) >= WOKEN, delays
    running.stop()
    output = running.output()
    [warning] = [line for line in output.splitlines() if WARNED in line]
    assert f"WARNING wake-ups off, idle consumers poll every {POLL} s" in warning, output
    assert "{'default': ALIAS}" in warning and "session pool" in warning, output
    assert advisory_locks(fresh) == []


def test_the_shapes_run_in_settings_the_check_accepts(bouncer):
    """The settings the tests above use pass the system checks (LISTEN_DATABASES' aliases
    exist), and a name missing from DATABASES is refused at start."""
    env = bouncer.child_env(TRANSACTION, {"listen": DIRECT}, LISTEN_DIRECT)
    run_django(env, "check")
    bad = bouncer.child_env(TRANSACTION, settings={"LISTEN_DATABASES": {"default": "direct"}})
    done = subprocess.run(  # noqa: S603 - our own command line
        [sys.executable, "-m", "django", "run_queue_consumer", "noop", "--burst"],
        env=bad,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0
    assert "TXQUEUE['LISTEN_DATABASES'] is {'default': 'direct'}" in done.stderr, done.stderr
