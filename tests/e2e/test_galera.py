"""A three-node MariaDB Galera cluster (``galera.py``): producers on every node, consumers
on different nodes, a node SIGKILLed mid-drain and started again; every committed item
DONE exactly once by claim, none lost, no producer dead.

Galera has no cluster-wide row locks: a transaction that conflicts with another node's is
refused at COMMIT (1213, "Deadlock found"). The library runs its own transactions again
(claims, acknowledgements, heartbeats, rescues, an enqueue outside a transaction); a
producer's own transaction runs again through ``run_in_transaction``.

Runs in the MariaDB suite run (``TXQUEUE_TEST_DB=mysql``); skipped elsewhere, and where
galera-4, rsync or the MariaDB server are missing, except under ``CI=true``, where that
is a failure. ``TXQUEUE_GALERA_LONG=1`` adds the long form, whose report (both strategies,
one node against three, writes on one node against all, a node killed) is printed and
written to ``galera-report.json`` in the test's temporary directory
(docs/scaling.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from .galera import (
    QUEUE,
    GaleraCluster,
    clear,
    migrated_cluster,
    node_env,
    run_workload,
)
from .servers import DBNAME, DONE, ROOT, enqueue, needs_servers, run_django

pytestmark = pytest.mark.slow
TABLE = "django_txqueue_queueitem"


@pytest.fixture(scope="module")
def cluster():
    needs_servers("mysql", GaleraCluster.missing(), "the Galera tests")
    started = migrated_cluster()
    yield started
    started.destroy()


def assert_exactly_once(report):
    """Every committed item stored once, DONE once by claim; none lost; no producer dead."""
    assert report["producers_died"] == [], report["producer_errors"]
    assert report["lost"] == 0, report
    assert report["stored_twice"] == 0, report
    assert report["items"] == report["expected"], report
    assert report["status"] == {DONE: report["expected"]}, report
    assert report["done_twice"] == 0 and report["done_never"] == 0, report


def test_a_drain_with_producers_on_every_node_and_a_node_killed(cluster, tmp_path):
    """skip_locked (what ``auto`` picks): a producer on each node, two of them enqueueing
    outside any transaction (the library's own, run again on a conflict), one in its own
    transaction through ``run_in_transaction``; a consumer on each node. The third node is
    SIGKILLed mid-drain: its consumer loses its connection, its claims are rescued by the
    others once their lease is over, its producer goes on through another node; the node
    is started again and rejoins."""
    report = run_workload(
        cluster,
        tmp_path,
        strategy="skip_locked",
        mode="many,atomic",
        batches=25,
        kill=2,
        kill_after=0.3,
        pause=0.1,
        timeout=100,
    )
    assert_exactly_once(report)
    assert report["rejoin_seconds"] is not None and cluster.size() == 3
    # The node died mid-drain and mid-production: its consumer's work was left to the
    # others, and its producer went on through another node.
    assert report["done_at_kill"] < report["expected"], report
    assert report["producers"]["p2"]["failovers"] >= 1, report
    # The cluster refused transactions, and no producer saw it (none died of it).
    assert report["galera_refusals"] > 0, report
    print(json.dumps(report))


def test_update_limit_claims_on_every_node(cluster, tmp_path):
    """update_limit: producers in their own transactions (``run_in_transaction``) on every
    node, consumers on every node."""
    report = run_workload(
        cluster, tmp_path, strategy="update_limit", mode="atomic", batches=15, timeout=60
    )
    assert_exactly_once(report)
    assert report["galera_refusals"] > 0, report
    print(json.dumps(report))


def test_writes_of_different_items_on_two_nodes_do_not_conflict(cluster):
    """Certification compares the keys of the rows written, unique keys included: with the
    dedup index on (queue, active_dedup_key), ("atomic", NULL) was every item's key, and
    26-93% of such pairs were refused (migration 0011). Now only a write of the same row
    (or of the same unfinished dedup_key) can conflict."""
    clear(cluster.nodes[0])
    enqueue(cluster.nodes[0], QUEUE, "[{'n': n} for n in range(100)]")
    ids = [row[0] for row in cluster.nodes[0].query(DBNAME, f"SELECT id FROM {TABLE}")]
    first, second = (node.connect(DBNAME) for node in cluster.nodes[:2])
    refused = []
    try:
        for pair in range(len(ids) // 2):
            both_wrote = threading.Barrier(2, timeout=10)

            def write(connection, pk, both_wrote=both_wrote):
                cursor = connection.cursor()
                cursor.execute("START TRANSACTION")
                cursor.execute(f"UPDATE {TABLE} SET last_error = 'x' WHERE id = %s", (pk,))
                both_wrote.wait()  # both commit at once: each certified against the other
                try:
                    cursor.execute("COMMIT")
                except Exception as exc:
                    refused.append(exc)

            threads = [
                threading.Thread(target=write, args=(first, ids[2 * pair])),
                threading.Thread(target=write, args=(second, ids[2 * pair + 1])),
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
    finally:
        first.close()
        second.close()
    assert not refused, f"{len(refused)} of {len(ids) // 2} pairs refused: {refused[0]}"


def check(node, strategy):
    """``manage.py check --database default`` on ``node``: its output (warnings on stderr)."""
    done = subprocess.run(
        [sys.executable, "-m", "django", "check", "--database", "default"],
        env=node_env(node, {"CLAIM_STRATEGY": strategy}),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return done.stdout + done.stderr


def test_the_check_warns_of_update_limit_on_a_galera_node(cluster):
    """Detected from ``wsrep_on``; a plain server gets no such warning
    (tests/test_transactions.py)."""
    assert "txqueue.W003" in check(cluster.nodes[0], "update_limit")
    assert "txqueue.W003" not in check(cluster.nodes[0], "auto")


@pytest.mark.skipif(not os.environ.get("TXQUEUE_GALERA_LONG"), reason="TXQUEUE_GALERA_LONG=1")
def test_long_form_report(cluster, tmp_path):
    """The figures of docs/scaling.md: each strategy with writes on one node and on
    all, a node killed, and one node of its own (a cluster of one) for comparison."""
    runs = []
    for strategy in ("skip_locked", "update_limit"):
        for label, options in (
            ("3 nodes, all on node0", {"producers_on": [0, 0, 0], "consumers_on": [0, 0, 0]}),
            ("3 nodes, writes on node0, consumers on all", {"producers_on": [0, 0, 0]}),
            ("3 nodes, writes and consumers on all", {}),
            ("3 nodes, all, node2 killed", {"kill": 2, "kill_after": 0.3, "pause": 0.1}),
        ):
            scratch = tmp_path / f"{strategy}-{len(runs)}"
            scratch.mkdir()
            report = run_workload(
                cluster, scratch, strategy=strategy, mode="many,atomic", batches=50,
                timeout=300, **options,
            )  # fmt: skip
            report["shape"] = label
            runs.append(report)
            print(json.dumps(report), flush=True)
            assert_exactly_once(report)
    single = GaleraCluster(size=1)
    try:
        single.start()
        single.nodes[0].create_database("txqueue_e2e")
        run_django(node_env(single.nodes[0]), "migrate", "--noinput", "-v", "0")
        for strategy in ("skip_locked", "update_limit"):
            scratch = tmp_path / f"single-{strategy}"
            scratch.mkdir()
            report = run_workload(
                single, scratch, strategy=strategy, mode="many,atomic", batches=50,
                producers_on=[0, 0, 0], consumers_on=[0, 0, 0], timeout=300,
            )  # fmt: skip
            report["shape"] = "1 node"
            runs.append(report)
            print(json.dumps(report), flush=True)
            assert_exactly_once(report)
    finally:
        single.destroy()
    (tmp_path / "galera-report.json").write_text(json.dumps(runs, indent=1))
