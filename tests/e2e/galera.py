"""A throwaway three-node MariaDB Galera cluster on the loopback, for end-to-end tests.

Debian's ``galera-4`` provider (``/usr/lib/galera/libgalera_smm.so``) and the machine's
MariaDB 10.11 binaries. Each node has its own data directory (``mariadb-install-db``), its
own SQL port and its own group-communication, IST and SST ports, all on 127.0.0.1, so the
shared server on 3306 is never touched. The first node bootstraps the cluster
(``--wsrep-new-cluster``); the others join it and receive its state by SST (``rsync``).

``kill(node)`` SIGKILLs a node; ``start`` on it again rejoins the cluster (IST when the
donor's gcache still holds what it missed, else SST). ``destroy()`` stops every node by its
own pid and removes the directories; it is safe to call more than once.

    python -m tests.e2e.galera          # start a cluster, print its ports, wait for ^C
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .servers import (
    DBNAME,
    ROOT,
    MariaDBServer,
    child_env,
    free_port,
    is_root,
    launch,
    read_pid,
    run_django,
    tail,
)

PROVIDER = Path("/usr/lib/galera/libgalera_smm.so")
CLUSTER_NAME = "txqueue_e2e"
SYNC_TIMEOUT = 90.0  # seconds for a node to join and reach Synced (an SST included)
# Run as root, the nodes run as this OS user: the joiner's rsync daemon, started by the
# SST script, would otherwise run as "nobody", who may not write the root's data directory.
OS_USER = "mysql"


class GaleraNode(MariaDBServer):
    """One mariadbd of the cluster. ``port`` is its SQL port; ``query``/``connect`` as for
    any throwaway MariaDB server (``servers.py``)."""

    def __init__(self, root: Path, name: str) -> None:  # no super(): the data dir is ours
        server, install = self.binaries()
        assert server is not None and install is not None, self.missing()
        self.server, self.install = server, install
        self.name = name
        self.root = root
        self.root.mkdir(parents=True)
        if is_root():
            entry = pwd.getpwnam(OS_USER)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.port = free_port()
        self.gcomm_port = free_port()
        self.ist_port = free_port()
        self.sst_port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.cluster_address = ""

    def install_db(self) -> None:
        command = [
            self.install,
            "--no-defaults",
            f"--datadir={self.data}",
            "--auth-root-authentication-method=normal",
            "--skip-test-db",
        ]
        if is_root():
            command.append(f"--user={OS_USER}")
        # Its temporary files in the node's own directory: the OS user it runs as may not
        # write to $TMPDIR (CI's is root's).
        env = {**os.environ, "TMPDIR": str(self.root)}
        done = subprocess.run(  # noqa: S603
            command, capture_output=True, text=True, timeout=120, check=False, env=env
        )
        if done.returncode != 0:
            raise RuntimeError(f"mariadb-install-db failed: {done.stdout}{done.stderr}")

    def start_command(self, bootstrap: bool = False) -> list[str]:
        provider_options = (
            f"gmcast.listen_addr=tcp://127.0.0.1:{self.gcomm_port}; "
            f"ist.recv_addr=127.0.0.1:{self.ist_port}; "
            # A small ring buffer (the default 128M file is written out at start-up), still
            # enough for a node SIGKILLed for seconds to rejoin by IST.
            "gcache.size=64M; "
            # A dead node is noticed in about 3 s, not the default 5-15 s.
            "evs.suspect_timeout=PT3S; evs.inactive_timeout=PT6S; evs.install_timeout=PT3S"
        )
        command = [
            *(arg for arg in MariaDBServer.start_command(self) if arg != "--user=root"),
            "--wsrep-on=ON",
            f"--wsrep-provider={PROVIDER}",
            f"--wsrep-cluster-name={CLUSTER_NAME}",
            f"--wsrep-cluster-address={self.cluster_address}",
            f"--wsrep-node-name={self.name}",
            f"--wsrep-node-address=127.0.0.1:{self.gcomm_port}",
            f"--wsrep-node-incoming-address=127.0.0.1:{self.port}",
            f"--wsrep-provider-options={provider_options}",
            f"--wsrep-sst-receive-address=127.0.0.1:{self.sst_port}",
            "--wsrep-sst-method=rsync",
            "--binlog-format=ROW",
            "--innodb-autoinc-lock-mode=2",
            "--default-storage-engine=InnoDB",
            "--innodb-log-file-size=16M",
            f"--tmpdir={self.root}",  # as for install_db
        ]
        if is_root():
            command.append(f"--user={OS_USER}")
        if bootstrap:
            command.append("--wsrep-new-cluster")
        return command

    def start(self, bootstrap: bool = False) -> None:
        """Start the node and wait until it is Synced with the cluster."""
        if bootstrap:
            self._bootstrappable()
        (self.root / "server.json").write_text(
            json.dumps({"command": self.start_command(), "port": self.port})
        )
        self.process = launch(self.root, self.start_command(bootstrap))
        self.wait_synced(time.monotonic() + SYNC_TIMEOUT)

    def _bootstrappable(self) -> None:
        """A node that was stopped last, or never started, may bootstrap."""
        state = self.data / "grastate.dat"
        if state.exists():
            text = state.read_text().replace("safe_to_bootstrap: 0", "safe_to_bootstrap: 1")
            state.write_text(text)

    def status(self, name: str) -> str | None:
        """A wsrep status variable of this node (``wsrep_ready``...), None if unreachable."""
        try:
            rows = self.query("", "SHOW GLOBAL STATUS LIKE %s", (name,))
        except Exception:  # still starting, or down
            return None
        return str(rows[0][1]) if rows else None

    def wait_synced(self, deadline: float) -> None:
        last = None
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited ({self.process.returncode}):\n{tail(self.log, 40)}"
                )
            last = (self.status("wsrep_ready"), self.status("wsrep_local_state_comment"))
            if last == ("ON", "Synced"):
                return
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not Synced ({last}):\n{tail(self.log, 40)}")

    def kill(self) -> None:
        """SIGKILL, as a crash or a power cut would."""
        pid = read_pid(self.pid_file) or (self.process.pid if self.process else None)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.process is not None:
            self.process.wait(timeout=10)
            self.process = None
        self.pid_file.unlink(missing_ok=True)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def destroy(self) -> None:
        self.kill()


class GaleraCluster:
    """Three (``size``) nodes on the loopback; ``nodes[0]`` bootstrapped the cluster."""

    @classmethod
    def missing(cls) -> str | None:
        """Why a cluster cannot be started here, or None."""
        reason = MariaDBServer.missing()
        if reason:
            return reason
        if is_root():
            try:
                pwd.getpwnam(OS_USER)
            except KeyError:
                return f"running as root and no {OS_USER!r} OS user to run the nodes as"
        if not PROVIDER.exists():
            return f"no Galera provider {PROVIDER} (Debian package galera-4)"
        for program in ("rsync", "wsrep_sst_rsync"):
            if shutil.which(program) is None:
                return f"no {program} for Galera's state transfers (Debian package rsync)"
        return None

    def __init__(self, size: int = 3) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="txqueue-e2e-galera-"))
        try:
            if is_root():
                entry = pwd.getpwnam(OS_USER)
                os.chown(self.root, entry.pw_uid, entry.pw_gid)
            self.nodes = [GaleraNode(self.root / f"node{n}", f"node{n}") for n in range(size)]
            address = ",".join(f"127.0.0.1:{node.gcomm_port}" for node in self.nodes)
            for node in self.nodes:
                node.cluster_address = f"gcomm://{address}"
                node.install_db()
        except BaseException:
            self.destroy()
            raise

    def start(self) -> None:
        """Bootstrap the first node, then join the others one by one (each by SST)."""
        try:
            self.nodes[0].start(bootstrap=True)
            for node in self.nodes[1:]:
                node.start()
            self.wait_size(len(self.nodes))
        except BaseException:
            self.destroy()
            raise

    def size(self, through: GaleraNode | None = None) -> int:
        """``wsrep_cluster_size`` as a running node (``through``, else the first) sees it."""
        nodes = [through] if through else [n for n in self.nodes if n.running]
        for node in nodes:
            value = node.status("wsrep_cluster_size")
            if value is not None:
                return int(value)
        return 0

    def wait_size(self, size: int, timeout: float = SYNC_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            running = [node for node in self.nodes if node.running]
            if all(
                self.size(node) == size and node.status("wsrep_ready") == "ON" for node in running
            ):
                return
            time.sleep(0.2)
        raise RuntimeError(f"the cluster did not reach size {size}: {self.size()}")

    def kill(self, node: GaleraNode) -> None:
        """SIGKILL ``node``; returns once the others have noticed (size one less)."""
        node.kill()
        self.wait_size(sum(n.running for n in self.nodes))

    def restart(self, node: GaleraNode) -> float:
        """Start a killed node again: it rejoins by IST or SST. Seconds it took."""
        started = time.monotonic()
        node.start()
        self.wait_size(sum(n.running for n in self.nodes))
        return time.monotonic() - started

    def query(self, dbname: str, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        """A statement on the first running node."""
        node = next(n for n in self.nodes if n.running)
        return node.query(dbname, sql, params)

    def destroy(self) -> None:
        for node in getattr(self, "nodes", []):
            node.destroy()
        if not os.environ.get("TXQUEUE_GALERA_KEEP"):  # its logs, for a post-mortem
            shutil.rmtree(self.root, ignore_errors=True)


# -- the workload: producers and consumers on the nodes, and what they came to ------------
#
# Producers and consumers are Django processes (``tests.settings``) on the database DBNAME
# of one node each. A producer commits ``batches`` transactions of ``per`` items of queue
# QUEUE, whose atomic handler (tests/testapp/queues.py "atomic") writes a Run row in the
# transaction that acknowledges the item: a DONE item has one Run row per claim that
# completed it.

QUEUE = "atomic"
SHUTDOWN_LINE = re.compile(r"shutdown timeout: (\d+) items? left IN_PROGRESS")
PRODUCER_MODES = ("many", "atomic", "bare")


def node_env(node: GaleraNode, settings: dict[str, Any] | None = None) -> dict[str, str]:
    return child_env(node, settings)


def start_producer(
    node: GaleraNode,
    tag: str,
    batches: int,
    per: int,
    mode: str,
    out: Path,
    others=(),
    pause: float = 0.0,
) -> subprocess.Popen[bytes]:
    """``python -m tests.e2e.galera produce``: see ``produce``. Its JSON summary goes to
    ``out``, its errors to ``out`` + ".err"."""
    ports = ",".join(str(n.port) for n in (node, *others))
    command = [sys.executable, "-m", "tests.e2e.galera", "produce", tag, str(batches)]
    command += [str(per), mode, ports, str(pause)]
    with open(out, "wb") as stdout, open(f"{out}.err", "wb") as stderr:
        return subprocess.Popen(  # noqa: S603
            command, env=node_env(node), cwd=ROOT, stdout=stdout, stderr=stderr
        )


def produce(
    tag: str, batches: int, per: int, mode: str, ports: list[int], pause: float = 0.0
) -> dict[str, Any]:
    """Commit ``batches`` transactions of ``per`` items, each payload ``{"p": tag, "b":
    batch, "n": n}``, through the first of ``ports``:

    - ``many``: ``enqueue_many`` outside any transaction (the library's own transaction);
    - ``atomic``: ``per`` ``enqueue`` calls in the caller's ``transaction.atomic()``, run
      again on a conflict by ``run_in_transaction``;
    - ``bare``: the same transaction, not run again (as a user would write it naively).

    When its node goes away, the producer moves on to the next of ``ports`` and asks
    there whether the batch it was committing landed before sending it again (a COMMIT
    whose answer was lost may have): every batch is stored once.
    """
    import django
    from django.db import InterfaceError, OperationalError, connection, transaction

    django.setup()
    from django_txqueue import enqueue, enqueue_many
    from django_txqueue.models import QueueItem

    try:
        from django_txqueue import run_in_transaction
    except ImportError:  # the code before the fix: the naive transaction
        run_in_transaction = None

    summary = {"tag": tag, "batches": 0, "items": 0, "conflicts": 0, "failovers": 0}
    conflicts = 0

    def counted(func):  # how often run_in_transaction ran a refused transaction again
        def run():
            nonlocal conflicts
            conflicts += 1
            return func()

        return run

    def landed(batch: int) -> bool:
        return QueueItem.objects.filter(queue=QUEUE, payload__p=tag, payload__b=batch).exists()

    home = 0
    for batch in range(batches):
        payloads = [{"p": tag, "b": batch, "n": n} for n in range(per)]
        while True:
            try:
                if mode == "many":
                    enqueue_many(QUEUE, payloads)
                else:

                    def write(payloads=payloads):
                        with transaction.atomic():
                            for payload in payloads:
                                enqueue(QUEUE, payload)

                    if mode == "atomic" and run_in_transaction is not None:
                        conflicts -= 1  # the first run is no conflict
                        run_in_transaction(counted(write))
                    else:
                        write()
                break
            except (OperationalError, InterfaceError) as exc:
                if exc.args and exc.args[0] == 1213:
                    raise  # a refused COMMIT not run again: the producer dies
                # The node went away: go on through the next one, unless the batch landed.
                connection.close()
                home = (home + 1) % len(ports)
                connection.settings_dict["PORT"] = str(ports[home])
                summary["failovers"] += 1
                time.sleep(0.5)
                try:
                    if landed(batch):
                        break
                except (OperationalError, InterfaceError):
                    continue
        summary["batches"] += 1
        time.sleep(pause)  # paced: still producing when a node is killed
        summary["items"] += per
    summary["conflicts"] = max(conflicts, 0)
    return summary


class Consumer:
    """A ``run_queue_consumer`` process on one node; its log in ``log``."""

    def __init__(self, node: GaleraNode, log: Path, *args: str, settings=None) -> None:
        self.node, self.log, self.args = node, log, args
        with open(log, "ab") as stderr:
            self.process = subprocess.Popen(  # noqa: S603
                [sys.executable, "-m", "django", "run_queue_consumer", *args],
                env=node_env(node, settings),
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
            )

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> int | None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait(timeout=10)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def audit(node: GaleraNode) -> dict[str, Any]:
    """What the run came to, read on ``node``: counts by status, items lost or doubled
    by producers (a payload stored twice), completions per item (Run rows), attempts."""
    rows = node.query(
        DBNAME,
        "SELECT i.id, i.status, i.attempts, i.payload, COUNT(r.id) FROM "
        "django_txqueue_queueitem i LEFT JOIN testapp_run r ON r.item_id = i.id "
        "WHERE i.queue = %s GROUP BY i.id, i.status, i.attempts, i.payload",
        (QUEUE,),
    )
    status: dict[int, int] = {}
    payloads: dict[tuple[str, int, int], int] = {}
    runs: dict[int, int] = {}
    extra_attempts = 0
    for pk, state, attempts, payload, completions in rows:
        status[int(state)] = status.get(int(state), 0) + 1
        value = node.decode_json(payload)
        key = (value["p"], value["b"], value["n"])
        payloads[key] = payloads.get(key, 0) + 1
        runs[int(pk)] = int(completions)
        extra_attempts += int(attempts) - 1
    return {
        "items": len(rows),
        "status": status,
        "stored_twice": sum(1 for n in payloads.values() if n > 1),
        "keys": set(payloads),
        "done_twice": sum(1 for n in runs.values() if n > 1),
        "done_never": sum(1 for pk, n in runs.items() if n == 0),
        "extra_attempts": extra_attempts,
        "items_with_extra_attempts": sum(1 for _ in rows if int(_[2]) > 1),
    }


def expected_keys(tags: dict[str, int], per: int) -> set[tuple[str, int, int]]:
    return {(t, b, n) for t, batches in tags.items() for b in range(batches) for n in range(per)}


# The consumers' settings: quick heartbeats, rescues and retries, a short lease.
CONSUMER_SETTINGS = {
    "HEARTBEAT_INTERVAL": 0.5,
    "POLL_INTERVAL": 0.2,
    "RESCUE_INTERVAL": 1,
    "CONSUMER_TIMEOUT": 5,
    "RETRY_DELAY": 0.2,
    "RETRY_MAX_DELAY": 1,
    "LEASE": 5,
    "SHUTDOWN_TIMEOUT": 5,
}


def migrated_cluster() -> GaleraCluster:
    """A started cluster with the test database DBNAME migrated (through the first node:
    DDL replicates to the others)."""
    cluster = GaleraCluster()
    cluster.start()
    try:
        cluster.nodes[0].create_database(DBNAME)
        run_django(node_env(cluster.nodes[0]), "migrate", "--noinput", "-v", "0")
    except BaseException:
        cluster.destroy()
        raise
    return cluster


def refusals(cluster: GaleraCluster) -> int:
    """Transactions the cluster's nodes refused since they started: certification failures
    and brute-force aborts (``wsrep_local_cert_failures``, ``wsrep_local_bf_aborts``)."""
    total = 0
    for node in cluster.nodes:
        for name in ("wsrep_local_cert_failures", "wsrep_local_bf_aborts"):
            total += int(node.status(name) or 0)
    return total


def clear(node: GaleraNode) -> None:
    for table in ("django_txqueue_queueitem", "django_txqueue_consumer", "testapp_run"):
        node.query(DBNAME, f"DELETE FROM {table}")


def run_workload(
    cluster: GaleraCluster,
    scratch: Path,
    *,
    strategy: str = "auto",
    mode: str = "many",
    batches: int = 50,
    per: int = 20,
    producers_on: list[int] | None = None,
    consumers_on: list[int] | None = None,
    kill: int | None = None,
    kill_after: float = 0.5,
    pause: float = 0.0,
    down: float = 2.0,
    timeout: float = 120.0,
) -> dict[str, Any]:
    """One run: a producer on each of ``producers_on`` (node indexes, all by default)
    committing ``batches`` transactions of ``per`` items (``produce``'s ``mode``, or
    modes separated by commas, taken in turn by the producers), one
    ``run_queue_consumer --concurrency 2 --batch 10`` on each of ``consumers_on``. With
    ``kill``, that node is SIGKILLed once ``kill_after`` of the items are stored (mid-
    production while producers write) and some are DONE, and
    started again ``down`` seconds later. ``pause``: seconds each producer waits between
    its transactions. Returns the report: the audit, the producers'
    summaries, the consumers' exit codes and logged conflicts, the drain's rate."""
    nodes = cluster.nodes
    producers_on = list(range(len(nodes))) if producers_on is None else producers_on
    consumers_on = list(range(len(nodes))) if consumers_on is None else consumers_on
    clear(nodes[0])
    refused_before = refusals(cluster)
    total = batches * per * len(producers_on)
    args = (QUEUE, "--concurrency", "2", "--batch", "10", "--strategy", strategy)
    started = time.monotonic()
    consumers = [
        Consumer(nodes[i], scratch / f"consumer{n}.log", *args, settings=CONSUMER_SETTINGS)
        for n, i in enumerate(consumers_on)
    ]
    producers = {}
    modes = mode.split(",")  # one per producer, in turn
    for n, i in enumerate(producers_on):
        others = [node for node in nodes if node is not nodes[i]]
        out = scratch / f"producer{n}.json"
        producer_mode = modes[n % len(modes)]
        producers[f"p{n}"] = (
            start_producer(nodes[i], f"p{n}", batches, per, producer_mode, out, others, pause),
            out,
        )
    killed = restarted = done_at_kill = None
    rejoin = None
    done = 0
    deadline = started + timeout
    try:
        while time.monotonic() < deadline:
            alive = [n for n in nodes if n.running]
            try:
                counts = dict(
                    alive[0].query(
                        DBNAME,
                        "SELECT status, COUNT(*) FROM django_txqueue_queueitem GROUP BY status",
                    )
                )
            except Exception:  # a node dying under the query
                time.sleep(0.2)
                continue
            done = int(counts.get(3, 0))
            producing = any(p.poll() is None for p, _ in producers.values())
            stored = sum(int(n) for n in counts.values())
            # Mid-drain and, while producers write, mid-production too.
            if kill is not None and killed is None and done and stored >= kill_after * total:
                cluster.kill(nodes[kill])
                killed, done_at_kill = time.monotonic(), done
            if killed is not None and restarted is None and time.monotonic() > killed + down:
                rejoin = cluster.restart(nodes[kill])
                restarted = time.monotonic()
            settled = done + int(counts.get(4, 0)) == sum(int(n) for n in counts.values())
            if settled and not producing and (kill is None or restarted is not None):
                break
            time.sleep(0.2)
        drained = time.monotonic() - started
    finally:
        codes = [consumer.stop() for consumer in consumers]
        for process, _ in producers.values():
            if process.poll() is None:
                process.kill()
            process.wait(timeout=10)
    summaries = {}
    for tag, (process, out) in producers.items():
        text = out.read_text().strip()
        summaries[tag] = json.loads(text) if process.returncode == 0 and text else None
    logs = [consumer.output() for consumer in consumers]
    report = audit(nodes[0])
    # A restarted node counts from zero again: then a lower bound.
    report["galera_refusals"] = max(refusals(cluster) - refused_before, 0)
    expected = expected_keys(dict.fromkeys(producers, batches), per)
    report.update(
        strategy=strategy,
        mode=mode,
        expected=total,
        lost=len(expected - report.pop("keys")),
        producers=summaries,
        producers_died=[t for t, (p, out) in producers.items() if p.returncode != 0],
        producer_errors={
            t: tail(Path(f"{out}.err"), 3) for t, (p, out) in producers.items() if p.returncode
        },
        producer_conflicts=sum(s["conflicts"] for s in summaries.values() if s),
        consumer_exit_codes=codes,
        # A consumer that waited out its shutdown timeout on SIGTERM, and how many items it
        # said were still in flight (all are DONE by then when the audit passes).
        shutdown_timeouts=[int(found) for log in logs for found in SHUTDOWN_LINE.findall(log)],
        failed_attempts_logged=sum(log.count("failed (attempt") for log in logs),
        deadlocks_logged=sum(log.count("Deadlock found") for log in logs),
        seconds=round(drained, 2),
        rate=round(report["status"].get(3, 0) / drained, 1),
        killed=kill,
        done_at_kill=done_at_kill,
        rejoin_seconds=None if rejoin is None else round(rejoin, 1),
    )
    return report


def main(argv: list[str]) -> None:
    if argv[:1] == ["produce"]:
        tag, batches, per, mode, ports, pause = argv[1:7]
        nodes = [int(port) for port in ports.split(",")]
        summary = produce(tag, int(batches), int(per), mode, nodes, float(pause))
        print(json.dumps(summary))
        return
    reason = GaleraCluster.missing()
    if reason:
        raise SystemExit(reason)
    cluster = GaleraCluster()
    try:
        cluster.start()
        for node in cluster.nodes:
            print(node.name, "sql port", node.port, "gcomm", node.gcomm_port, node.root)
        print("cluster size", cluster.size(), "- ^C to stop and remove it")
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
    finally:
        cluster.destroy()


if __name__ == "__main__":
    main(sys.argv[1:])
