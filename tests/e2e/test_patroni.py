"""A Patroni failover mid-drain: nothing lost, nothing done twice, no attempt charged.

Three PostgreSQL nodes under Patroni with etcd, synchronous mode (``patroni.py``). Two
``run_queue_consumer`` processes with the atomic handler (its Run row commits with the
item's acknowledgement) and a producer (``enqueue_once``: a dedup key, run again until it
commits) reach the cluster as users would: Django's HOST and PORT as comma lists of every
node, ``OPTIONS={"target_session_attrs": "read-write"}`` (``patroni_settings.py``).
The leader is SIGKILLed (Patroni, postmaster and backends: a dead host) mid-drain.

Then every item ends DONE with exactly one committed run, none is lost (the producer's
items are all there, none twice), every item was claimed once as far as attempts go (the
items in flight at the kill went back READY uncharged), the consumers stop at once on
SIGTERM (no phantom in-flight item), and the first claim on the new leader follows its
promotion within ``FIRST_CLAIM_BOUND`` seconds. The figures are printed (``-s``).

Short form (CI, about a minute): one kill. Long form: ``TXQUEUE_PATRONI_LONG=1`` (more
items, several kills, each killed node restarted to rejoin); its report goes in
docs/scaling.md. PostgreSQL runs only (``TXQUEUE_TEST_DB=postgresql``); without
patroni/etcd it skips, except under ``CI=true``, where that is a failure.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from . import patroni
from .servers import DBNAME, DONE, ROOT, needs_servers, run_django, wait_for

pytestmark = pytest.mark.slow

LONG = os.environ.get("TXQUEUE_PATRONI_LONG") == "1"
ITEMS = 3000 if LONG else 600  # enqueued before the consumers start
PRODUCED = 1500 if LONG else 300  # enqueued by the producer while they drain
KILLS = 3 if LONG else 1
SECONDS_EACH = 0.03  # the handler's pause: the drain outlasts each failover
CONSUMERS, CONCURRENCY = 2, 4
# Seconds from the new leader accepting writes to the first claim on it: the consumers'
# reconnection pause is at most 1 s (+20% jitter); the rest is slack for a busy machine.
FIRST_CLAIM_BOUND = 2.5
SETTINGS = {
    "HEARTBEAT_INTERVAL": 0.5,
    "RESCUE_INTERVAL": 1,
    "POLL_INTERVAL": 0.5,
    # Longer than a failover: a consumer silent through it is not taken for dead, and its
    # claims are not rescued from under it (defaults: 60 s and 300 s).
    "CONSUMER_TIMEOUT": 60,
    "LEASE": 60,
    # A phantom in-flight item would show as a 30 s wait at SIGTERM.
    "SHUTDOWN_TIMEOUT": 30,
}


@pytest.fixture(scope="module")
def cluster():
    needs_servers("postgresql", patroni.missing(), "the Patroni failover test")
    started = patroni.PatroniCluster()
    try:
        started.start()
        started.wait_for_cluster()
        started.query("postgres", f'CREATE DATABASE "{DBNAME}"')
        django(started, "migrate", "--noinput", "-v", "0")
        yield started
    finally:
        started.destroy()


def env(cluster: patroni.PatroniCluster) -> dict[str, str]:
    """A Django process on the cluster's test database, reached through every node."""
    found = {k: v for k, v in os.environ.items() if not k.startswith("TXQUEUE_")}
    found.update(
        DJANGO_SETTINGS_MODULE="tests.e2e.patroni_settings",
        PYTHONPATH=str(ROOT),
        PYTHONUNBUFFERED="1",
        TXQUEUE_TEST_DB="postgresql",
        TXQUEUE_TEST_HOST=cluster.hosts(),
        TXQUEUE_TEST_PORT=cluster.ports(),
        TXQUEUE_TEST_USER="postgres",
        TXQUEUE_TEST_NAME=DBNAME,
        TXQUEUE_TEST_SETTINGS=json.dumps(SETTINGS),
    )
    return found


def django(cluster: patroni.PatroniCluster, *args: str) -> str:
    return run_django(env(cluster), *args)


class Process:
    """A ``python -m django`` child; its output in a file."""

    def __init__(self, cluster: patroni.PatroniCluster, log: Path, *args: str) -> None:
        self.log = log
        with open(log, "wb") as output:
            self.process = subprocess.Popen(  # noqa: S603
                [sys.executable, "-m", "django", *args],
                env=env(cluster),
                cwd=ROOT,
                stdout=output,
                stderr=subprocess.STDOUT,
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def assert_alive(self) -> None:
        assert self.process.poll() is None, f"{self.log.name} died:\n{self.output()}"

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


def count_done(cluster: patroni.PatroniCluster) -> int:
    return cluster.query(
        DBNAME, "SELECT COUNT(*) FROM django_txqueue_queueitem WHERE status = %s", (DONE,)
    )[0][0]


def first_claim_after(cluster: patroni.PatroniCluster, wall_clock: float) -> float | None:
    """When the first claim after ``wall_clock`` was made (the servers share our clock)."""
    return cluster.query(
        DBNAME,
        "SELECT EXTRACT(EPOCH FROM MIN(claimed_at))::float FROM django_txqueue_queueitem "
        "WHERE claimed_at > to_timestamp(%s)",
        (wall_clock,),
    )[0][0]


def last_replayed(node: patroni.Node) -> float:
    """When the last transaction ``node`` replayed as a replica committed (epoch), once
    promoted: PostgreSQL keeps that time after recovery ends."""
    with node.connect(DBNAME) as connection:
        found = connection.execute(
            "SELECT EXTRACT(EPOCH FROM pg_last_xact_replay_timestamp())::float"
        ).fetchone()[0]
    assert found is not None, "the new leader replayed nothing from the old one"
    return float(found)


def test_a_leader_killed_mid_drain_loses_nothing_and_does_nothing_twice(cluster, tmp_path):
    django(
        cluster,
        "shell",
        "-c",
        "from django_txqueue import enqueue_many; "
        f"enqueue_many('atomic', [{{'seconds': {SECONDS_EACH}}}] * {ITEMS})",
    )
    total = ITEMS + PRODUCED
    consumers = [
        Process(cluster, tmp_path / f"consumer{n}.log", "run_queue_consumer", "atomic",
                "--concurrency", str(CONCURRENCY), "-v", "2")
        for n in range(CONSUMERS)
    ]  # fmt: skip
    producer = Process(
        cluster,
        tmp_path / "producer.log",
        "shell",
        "-c",
        "from tests.e2e.patroni import produce; "
        f"produce('atomic', {PRODUCED}, 0.02, {{'seconds': {SECONDS_EACH}}})",
    )
    failovers = []
    started = time.monotonic()
    try:
        for kill in range(KILLS):
            # Mid-drain: a share of the items done, most still to come.
            wait_for(
                lambda n=kill: count_done(cluster) >= total * (n + 0.3) / (KILLS + 1),
                120,
                "the drain to get going",
            )
            for running in consumers:
                running.assert_alive()
            done_then = count_done(cluster)
            killed_at = time.time()
            killed = cluster.kill_leader()
            leader = cluster.wait_for_writable()
            writable_at = time.time()
            # Claims on the new leader: made after the last transaction it replayed from
            # the old one (whose last commits may come after our clock's kill).
            replayed = max(last_replayed(leader), killed_at)
            first = wait_for(
                lambda at=replayed: first_claim_after(cluster, at), 60, "a claim on the new leader"
            )
            failovers.append(
                {
                    "killed": killed.name,
                    "new leader": leader.name,
                    "done before": done_then,
                    "kill to writable": round(writable_at - killed_at, 2),
                    "writable to first claim": round(first - writable_at, 2),
                    "kill to first claim": round(first - killed_at, 2),
                }
            )
            if kill < KILLS - 1:
                cluster.restart(killed)
                cluster.wait_for_cluster()

        assert producer.process.wait(timeout=180) == 0, producer.output()
        produced = json.loads(producer.output().strip().splitlines()[-1])
        wait_for(lambda: count_done(cluster) >= total, 180, f"all {total} items DONE")
        drained_in = time.monotonic() - started
        for running in consumers:
            running.assert_alive()

        # SIGTERM: nothing in flight any more, so each stops at once.
        stopping = time.monotonic()
        for running in consumers:
            running.process.send_signal(signal.SIGTERM)
        codes = [running.process.wait(timeout=60) for running in consumers]
        stopped_in = time.monotonic() - stopping
    finally:
        for running in [*consumers, producer]:
            running.kill()

    logs = "\n".join(running.output() for running in consumers)
    rows = cluster.query(
        DBNAME,
        "SELECT i.id, i.status, i.attempts, i.last_error, i.dedup_key, COUNT(r.id) "
        "FROM django_txqueue_queueitem i LEFT JOIN testapp_run r ON r.item_id = i.id "
        "GROUP BY i.id",
    )
    orphans = cluster.query(
        DBNAME,
        "SELECT COUNT(*) FROM testapp_run r "
        "WHERE NOT EXISTS (SELECT 1 FROM django_txqueue_queueitem i WHERE i.id = r.item_id)",
    )[0][0]
    released = logs.count("the database failed, not the handler; back to READY")
    charged = [(pk, attempts, error) for pk, _, attempts, error, *_ in rows if attempts != 1]
    report = {
        "items": len(rows),
        "kills": KILLS,
        "failovers": failovers,
        "producer": produced,
        "lost": total - len(rows),
        "doubled": sum(runs > 1 for *_, runs in rows),
        "released uncharged": released,
        "charged an attempt": len(charged),
        "drain (s)": round(drained_in, 1),
        "items/s, failovers included": round(total / drained_in, 1),
        "SIGTERM to exit (s)": round(stopped_in, 1),
    }
    print(f"\nPatroni failover: {json.dumps(report, indent=1)}")

    assert codes == [0] * CONSUMERS, logs
    assert "items left IN_PROGRESS" not in logs, logs
    assert stopped_in < 10, f"the consumers waited {stopped_in:.0f} s to stop:\n{logs}"
    # None lost: every item enqueued (the producer's once each) is there.
    assert produced["stored"] + produced["found"] == PRODUCED, produced
    producer_keys = [key for *_, key, _ in rows if key is not None]
    assert len(producer_keys) == len(set(producer_keys)) == PRODUCED
    assert len(rows) == total, report
    # Each DONE once by claim: one committed run, on the first attempt, no error kept.
    assert {status for _, status, *_ in rows} == {DONE}, report
    assert [row for row in rows if row[5] != 1] == [] and orphans == 0, report
    assert charged == [], f"{charged[:3]}\n{logs}"
    for failover in failovers:
        assert failover["writable to first claim"] < FIRST_CLAIM_BOUND, report
    assert "Traceback" not in logs, logs
