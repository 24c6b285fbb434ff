"""A throwaway Patroni cluster for the failover tests: one etcd, three PostgreSQL nodes.

Debian's packages: ``etcd`` (the v3 API; Patroni's ``etcd3:`` section, since etcd 3.4
serves no v2 API by default), ``patroni`` and PostgreSQL 15's binaries. Everything listens
on 127.0.0.1 on free ports, lives in one temporary directory, and is stopped by its own
pids. Patroni runs as the ``postgres`` OS user when we are root (PostgreSQL refuses root).

Synchronous mode is on: a commit returns once the synchronous standby has it, and Patroni
promotes only that standby, so a commit acknowledged before the leader died is on the new
leader. Timings are short (``TTL`` seconds for the leader key), so a promotion takes
seconds. ``kill_leader()`` SIGKILLs the leader's Patroni and its postmaster with every
child of it, as if the machine had died (its clients see their connections drop).

    cluster = PatroniCluster(); cluster.start(); cluster.wait_for_cluster()
    cluster.hosts(), cluster.ports()      # Django's HOST and PORT as comma lists
    killed = cluster.kill_leader(); cluster.wait_for_writable()
    cluster.restart(killed); cluster.wait_for_cluster()
    cluster.destroy()

``enqueue_once`` is how the test's producer enqueues across a failover (run in a Django
process on the cluster): the pattern docs/scaling.md gives.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from .servers import free_port, is_root, postgres_bindir, tail

PATRONI = "/usr/bin/patroni"
ETCD = "/usr/bin/etcd"
OS_USER = "postgres"
SCOPE = "txqueue"
# The leader key's time to live, Patroni's loop and its DCS retry, all short: a replica
# takes over about TTL seconds after the leader stops renewing its key.
TTL, LOOP_WAIT, RETRY_TIMEOUT = 10, 1, 4
START_TIMEOUT = 90.0


def missing() -> str | None:
    """Why a Patroni cluster cannot be started here, or None."""
    for path, package in ((PATRONI, "patroni"), (ETCD, "etcd-server")):
        if not os.access(path, os.X_OK):
            return f"no {path} (Debian package {package})"
    bindir = postgres_bindir()
    if bindir is None or not (bindir / "initdb").exists():
        return "no PostgreSQL server binaries under /usr/lib/postgresql/*/bin"
    if is_root():
        try:
            pwd.getpwnam(OS_USER)
        except KeyError:
            return f"running as root and no {OS_USER!r} OS user to run PostgreSQL as"
    return None


def descendants(pid: int) -> list[int]:
    """The pids of ``pid``'s children, grandchildren..., read from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                # The command name, in parentheses, may hold spaces: split after it.
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                parents[int(entry.name)] = int(fields[1])
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        children = [child for child, ppid in parents.items() if ppid == parent]
        found += children
        todo += children
    return found


def kill(pids: list[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


class Node:
    """One Patroni with its PostgreSQL."""

    def __init__(self, root: Path, name: str) -> None:
        self.name = name
        self.root = root / name
        self.data = self.root / "data"
        self.config = self.root / "patroni.yml"
        self.log = self.root / "patroni.log"
        self.port = free_port()
        self.api_port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    def postmaster_pid(self) -> int | None:
        """The running postmaster's pid (a stale pid file names no postgres process)."""
        try:
            pid = int((self.data / "postmaster.pid").read_text().split()[0])
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            return None
        return pid if b"postgres" in command else None

    def api(self, path: str, timeout: float = 2) -> tuple[int, Any]:
        """GET Patroni's REST API: status and decoded JSON (None when it is not JSON)."""
        url = f"http://127.0.0.1:{self.api_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as answer:  # noqa: S310
                status, body = answer.status, answer.read()
        except urllib.error.HTTPError as error:  # 503 from a health check that says no
            status, body = error.code, error.read()
        try:
            return status, json.loads(body)
        except ValueError:
            return status, None

    def connect(self, dbname: str = "postgres") -> Any:
        import psycopg

        return psycopg.connect(
            host="127.0.0.1",
            port=self.port,
            user="postgres",
            dbname=dbname,
            autocommit=True,
            connect_timeout=2,
        )

    def is_writable(self) -> bool:
        try:
            with self.connect() as connection:
                return connection.execute("SELECT NOT pg_is_in_recovery()").fetchone()[0]
        except Exception:  # down, starting, or refusing connections
            return False

    def kill(self) -> None:
        """SIGKILL Patroni, the postmaster and every process of that server: a dead host."""
        pids = [self.process.pid] if self.process is not None else []
        postmaster = self.postmaster_pid()
        if postmaster is not None:
            pids += [postmaster, *descendants(postmaster)]
        kill(pids)
        if self.process is not None:
            self.process.wait(timeout=10)


class PatroniCluster:
    """etcd and ``size`` Patroni nodes in one temporary directory."""

    def __init__(self, size: int = 3) -> None:
        bindir = postgres_bindir()
        assert bindir is not None, missing()
        self.bindir = bindir
        # Not pytest's tmp_path: the postgres OS user must reach its data directories.
        self.root = Path(tempfile.mkdtemp(prefix="txqueue-e2e-patroni-"))
        self.etcd_port, self.etcd_peer_port = free_port(), free_port()
        self.etcd: subprocess.Popen[bytes] | None = None
        self.nodes = [Node(self.root, f"node{n}") for n in range(1, size + 1)]
        self.killed: list[Node] = []

    # -- starting ----------------------------------------------------------------------

    def start(self) -> None:
        self.start_etcd()
        for node in self.nodes:
            node.root.mkdir()
            node.config.write_text(json.dumps(self.patroni_config(node), indent=1))
            if is_root():
                entry = pwd.getpwnam(OS_USER)
                os.chown(self.root, entry.pw_uid, entry.pw_gid)
                os.chown(node.root, entry.pw_uid, entry.pw_gid)
                os.chown(node.config, entry.pw_uid, entry.pw_gid)
        for node in self.nodes:
            self.start_node(node)

    def start_etcd(self) -> None:
        client = f"http://127.0.0.1:{self.etcd_port}"
        peer = f"http://127.0.0.1:{self.etcd_peer_port}"
        command = [
            ETCD,
            "--name=etcd",
            f"--data-dir={self.root / 'etcd'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=etcd={peer}",
            "--initial-cluster-state=new",
            "--unsafe-no-fsync",
        ]
        with open(self.root / "etcd.log", "ab") as output:
            self.etcd = subprocess.Popen(  # noqa: S603
                command, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.etcd.poll() is not None:
                raise RuntimeError(f"etcd exited:\n{tail(self.root / 'etcd.log')}")
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{client}/health", timeout=1) as answer,  # noqa: S310
            ):
                if json.loads(answer.read()).get("health") == "true":
                    return
            time.sleep(0.1)
        raise RuntimeError(f"etcd did not come up:\n{tail(self.root / 'etcd.log')}")

    def patroni_config(self, node: Node) -> dict[str, Any]:
        trust = [
            "local all all trust",
            "host all all 127.0.0.1/32 trust",
            "host replication all 127.0.0.1/32 trust",
        ]
        return {
            "scope": SCOPE,
            "name": node.name,
            "log": {"level": "INFO"},
            "restapi": {
                "listen": f"127.0.0.1:{node.api_port}",
                "connect_address": f"127.0.0.1:{node.api_port}",
            },
            # etcd 3.4 answers the v3 API only (its v2 API is off by default).
            "etcd3": {"hosts": [f"127.0.0.1:{self.etcd_port}"]},
            "bootstrap": {
                "dcs": {
                    "ttl": TTL,
                    "loop_wait": LOOP_WAIT,
                    "retry_timeout": RETRY_TIMEOUT,
                    "maximum_lag_on_failover": 1048576,
                    "synchronous_mode": True,
                    "postgresql": {
                        "use_pg_rewind": True,
                        "parameters": {
                            "max_connections": 100,
                            "fsync": "off",  # a test cluster: replication, not the disk
                            "wal_level": "replica",
                            "hot_standby": "on",
                            "max_wal_senders": 10,
                            "max_replication_slots": 10,
                            "wal_keep_size": "128MB",
                            "wal_log_hints": "on",  # for pg_rewind
                        },
                    },
                },
                "initdb": [{"encoding": "UTF8"}, {"auth": "trust"}, "no-sync"],
            },
            "postgresql": {
                "listen": f"127.0.0.1:{node.port}",
                "connect_address": f"127.0.0.1:{node.port}",
                "data_dir": str(node.data),
                "bin_dir": str(self.bindir),
                "pgpass": str(node.root / "pgpass"),
                "authentication": {
                    "superuser": {"username": "postgres"},
                    "replication": {"username": "postgres"},
                },
                "parameters": {"unix_socket_directories": str(node.root)},
                "pg_hba": trust,
                # A killed leader restarted (``restart``) may hold WAL the new leader
                # never had: rewound, or else made again from a copy of the leader.
                "use_pg_rewind": True,
                "remove_data_directory_on_rewind_failure": True,
                "remove_data_directory_on_diverged_timelines": True,
            },
        }

    def start_node(self, node: Node) -> None:
        env = {**os.environ, "HOME": str(node.root)}
        user = OS_USER if is_root() else None
        with open(node.log, "ab") as output:
            node.process = subprocess.Popen(  # noqa: S603
                [PATRONI, str(node.config)],
                stdout=output,
                stderr=subprocess.STDOUT,
                cwd=node.root,
                env=env,
                user=user,
                start_new_session=True,
            )

    # -- state ---------------------------------------------------------------------------

    @property
    def alive(self) -> list[Node]:
        return [node for node in self.nodes if node not in self.killed]

    def members(self) -> list[dict[str, Any]]:
        """``GET /cluster`` from the first live node that answers: each member's name,
        role (leader, sync_standby, replica) and state."""
        for node in self.alive:
            with contextlib.suppress(OSError, ValueError):
                status, body = node.api("/cluster")
                if status == 200 and body:
                    return list(body.get("members", []))
        return []

    def leader(self) -> Node | None:
        """The live node whose Patroni holds the leader key and runs as primary."""
        for member in self.members():
            if member.get("role") == "leader" and member.get("state") == "running":
                return next((n for n in self.alive if n.name == member["name"]), None)
        return None

    def wait_for_cluster(self, timeout: float = START_TIMEOUT) -> Node:
        """Until there is a leader and every other live node streams from it, one of them
        as the synchronous standby; the leader."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for node in self.alive:
                if node.process is not None and node.process.poll() is not None:
                    raise RuntimeError(f"patroni {node.name} exited:\n{tail(node.log)}")
            members = self.members()
            roles = sorted(m.get("role", "") for m in members if m.get("state") == "running")
            standbys = len(self.alive) - 1
            if len(roles) == len(self.alive) and "leader" in roles and "sync_standby" in roles:
                streaming = [m for m in members if m.get("role") != "leader"]
                if len(streaming) == standbys and all(m.get("lag") == 0 for m in streaming):
                    leader = self.leader()
                    if leader is not None and leader.is_writable():
                        return leader
            time.sleep(0.2)
        raise RuntimeError(f"no healthy Patroni cluster: {self.members()}\n{self.logs()}")

    def wait_for_writable(self, timeout: float = 60) -> Node:
        """Until a live node accepts writes (a promoted replica); that node."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for node in self.alive:
                if node.is_writable():
                    return node
            time.sleep(0.05)
        raise RuntimeError(f"no node accepts writes: {self.members()}\n{self.logs()}")

    def kill_leader(self) -> Node:
        leader = self.leader()
        assert leader is not None, f"no leader to kill: {self.members()}"
        leader.kill()
        self.killed.append(leader)
        return leader

    def restart(self, node: Node) -> None:
        """Start a killed node's Patroni again: it rejoins as a replica of the leader."""
        self.killed.remove(node)
        self.start_node(node)

    def hosts(self) -> str:
        """Django's HOST: every node, in libpq's comma list."""
        return ",".join("127.0.0.1" for _ in self.nodes)

    def ports(self) -> str:
        """Django's PORT: the nodes' ports, in the order of ``hosts()``."""
        return ",".join(str(node.port) for node in self.nodes)

    def connect(self, dbname: str = "postgres") -> Any:
        """A connection to whichever node accepts writes, as the clients find it."""
        import psycopg

        return psycopg.connect(
            host=self.hosts(),
            port=self.ports(),
            user="postgres",
            dbname=dbname,
            autocommit=True,
            connect_timeout=2,
            target_session_attrs="read-write",
        )

    def query(self, dbname: str, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self.connect(dbname) as connection:
            cursor = connection.execute(sql, params)
            return list(cursor.fetchall()) if cursor.description else []

    def logs(self) -> str:
        return "\n".join(f"--- {node.name}\n{tail(node.log, 15)}" for node in self.nodes)

    # -- stopping ------------------------------------------------------------------------

    def destroy(self) -> None:
        """Stop every process by its pid (Patroni first, so that it restarts nothing),
        then remove the directory. Safe to call more than once."""
        for node in self.nodes:
            node.kill()
        if self.etcd is not None and self.etcd.poll() is None:
            self.etcd.kill()
            self.etcd.wait(timeout=10)
        shutil.rmtree(self.root, ignore_errors=True)


# -- a producer across failovers (run in a Django process: ``python -m django shell``) -----


def enqueue_once(queue: str, payload: Any, key: str) -> tuple[bool, int]:
    """Enqueue one item so that it is stored once, however often the connection is lost
    under the try: whether this call stored it (False: a try that raised had), and how
    many tries failed.

    A COMMIT that raised (the connection dropped) may have landed; running the transaction
    again must not store the item twice. The ``dedup_key`` makes a second enqueue give way
    to an unfinished twin; a twin already DONE (claimed on the new leader meanwhile) is
    looked up first. Both in one transaction, run again until it commits.
    """
    from django.db import Error, InterfaceError, OperationalError, connection, transaction

    from django_txqueue import enqueue
    from django_txqueue.models import QueueItem

    failed = 0
    while True:
        try:
            with transaction.atomic():
                if QueueItem.objects.filter(queue=queue, dedup_key=key).exists():
                    return False, failed
                enqueue(queue, payload, dedup_key=key)
                return True, failed
        except (OperationalError, InterfaceError):  # the connection, not the data
            failed += 1
            with contextlib.suppress(Error):
                connection.close()  # the next try reconnects, to the new leader
            time.sleep(0.2)


def produce(queue: str, count: int, pause: float, payload: dict[str, Any]) -> None:
    """Enqueue ``count`` items, one per transaction, ``pause`` seconds apart; print a JSON
    report: items stored, items found stored by a try that had raised (its COMMIT
    landed), items that needed more than one try, and failed tries."""
    stored = found = retried = failures = 0
    for n in range(count):
        added, failed = enqueue_once(queue, {**payload, "n": n}, f"producer-{n}")
        stored += added
        found += not added
        retried += failed > 0
        failures += failed
        time.sleep(pause)
    report = {"stored": stored, "found": found, "retried": retried, "failures": failures}
    print(json.dumps(report))
