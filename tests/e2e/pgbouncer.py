"""A throwaway PgBouncer in front of the suite's PostgreSQL server, for the PgBouncer tests.

Debian's ``/usr/sbin/pgbouncer`` (1.18+), its own directory, port, log and pid: started
by ``start()``, stopped by its own pid. It serves one database of the server the suite
runs against (``TXQUEUE_TEST_HOST``/``PORT``, the shared 127.0.0.1:5432 by default) under
two names: its own in ``pool_mode=transaction`` (``POOL_SIZE`` server connections, small
as a transaction pool is meant to be) and with ``SESSION_SUFFIX`` in ``pool_mode=session``
(``SESSION_POOL_SIZE``: a session pool needs one server connection per client).
Authentication is ``trust`` with a temporary auth_file.

Django processes get ``tests.e2e.pgbouncer_settings`` through ``child_env``: the database
``default`` (through PgBouncer, or directly: ``default=``) and any other aliases named
(``aliases=``), each one of ``DIRECT``, ``TRANSACTION`` or ``SESSION``.

    python -m tests.e2e.pgbouncer [DBNAME]

starts one and prints its two DSNs until interrupted (for trying it by hand), and

    TXQUEUE_TEST_DB=postgresql python -m tests.e2e.pgbouncer measure [--items 3000]

measures drains and wake-ups in each shape, and

    TXQUEUE_TEST_DB=postgresql python -m tests.e2e.pgbouncer chaos [txqueue_chaos options]

runs ``txqueue_chaos`` through the transaction pool (docs/scaling.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .servers import DONE, FAST, ROOT, free_port, is_root, run_django, tail

BINARY = "/usr/sbin/pgbouncer"
OS_USER = "postgres"  # PgBouncer refuses to run as root: -u switches to this user
POOL_SIZE = 4
SESSION_POOL_SIZE = 30
SESSION_SUFFIX = "_session"
START_TIMEOUT = 15.0
# What a consumer logs when its LISTEN cannot hear notifications (wakeup.Waiter).
WARNED = "set TXQUEUE['LISTEN_DATABASES']"

# Where a Django alias connects: straight to PostgreSQL, or through one of the two pools.
DIRECT, TRANSACTION, SESSION = "direct", "transaction", "session"


def backend() -> tuple[str, int, str]:
    """The suite's PostgreSQL server: host, port, user."""
    host = os.environ.get("TXQUEUE_TEST_HOST", "127.0.0.1")
    port = int(os.environ.get("TXQUEUE_TEST_PORT", "5432"))
    return host, port, os.environ.get("TXQUEUE_TEST_USER", "postgres")


def binary() -> str | None:
    return BINARY if os.path.exists(BINARY) else shutil.which("pgbouncer")


class PgBouncer:
    def __init__(self, dbname: str) -> None:
        self.dbname = dbname
        self.root = Path(tempfile.mkdtemp(prefix="txqueue-e2e-pgbouncer-"))
        self.port = free_port()
        self.log = self.root / "pgbouncer.log"
        self.process: subprocess.Popen[bytes] | None = None
        host, port, user = backend()
        self.user = user
        server = f"host={host} port={port} dbname={dbname}"
        (self.root / "users.txt").write_text(f'"{user}" ""\n')
        (self.root / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"{dbname} = {server} pool_mode=transaction\n"
            f"{dbname}{SESSION_SUFFIX} = {server} pool_mode=session "
            f"pool_size={SESSION_POOL_SIZE}\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {self.port}\nunix_socket_dir =\n"
            f"auth_type = trust\nauth_file = {self.root / 'users.txt'}\n"
            f"admin_users = {user}\n"
            f"pool_mode = transaction\ndefault_pool_size = {POOL_SIZE}\n"
            "max_client_conn = 200\nserver_lifetime = 3600\n"
            f"logfile = {self.log}\npidfile = {self.root / 'pgbouncer.pid'}\n"
        )
        if is_root():
            entry = pwd.getpwnam(OS_USER)
            for path in (self.root, *self.root.iterdir()):
                os.chown(path, entry.pw_uid, entry.pw_gid)

    @classmethod
    def missing(cls) -> str | None:
        """Why no PgBouncer can be started here, or None."""
        if binary() is None:
            return f"no pgbouncer binary ({BINARY}; Debian package pgbouncer)"
        if is_root():
            try:
                pwd.getpwnam(OS_USER)
            except KeyError:
                return f"running as root and no {OS_USER!r} OS user to run pgbouncer as"
        return None

    def start(self) -> None:
        command = [str(binary())]
        if is_root():
            command += ["-u", OS_USER]
        command.append(str(self.root / "pgbouncer.ini"))
        self.process = subprocess.Popen(  # noqa: S603
            command, cwd=self.root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                self.connect().close()
                return
            except Exception as exc:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"pgbouncer on port {self.port} did not come up: {exc}\n{tail(self.log)}"
                    ) from exc
                time.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM (an immediate shutdown), by its own pid; and a restarted one's, by its
        pid file."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        stop_daemon(self.root)

    def restart_command(self) -> str:
        """A shell command that stops this PgBouncer, dropping every client's connection,
        and starts it again (as a daemon) on the same port (txqueue_chaos
        --restart-command)."""
        return shlex.join([sys.executable, "-m", "tests.e2e.pgbouncer", "restart", str(self.root)])

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def connect(self, mode: str = TRANSACTION) -> Any:
        import psycopg

        return psycopg.connect(**self.params(mode), autocommit=True, prepare_threshold=None)

    def params(self, mode: str) -> dict[str, Any]:
        """libpq parameters of a connection of ``mode`` (DIRECT, TRANSACTION, SESSION)."""
        host, port, user = backend()
        if mode == DIRECT:
            return {"host": host, "port": port, "user": user, "dbname": self.dbname}
        name = self.dbname + (SESSION_SUFFIX if mode == SESSION else "")
        return {"host": "127.0.0.1", "port": self.port, "user": self.user, "dbname": name}

    def database(self, mode: str) -> dict[str, Any]:
        """A Django DATABASES entry of ``mode``, with the settings Django documents for a
        transaction pool (no server-side cursors; psycopg's prepared statements are off by
        Django's default)."""
        params = self.params(mode)
        entry: dict[str, Any] = {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": params["dbname"],
            "USER": params["user"],
            "HOST": params["host"],
            "PORT": str(params["port"]),
            "TEST": {"MIRROR": "default"},
        }
        if mode == TRANSACTION:
            entry["DISABLE_SERVER_SIDE_CURSORS"] = True
        return entry

    def child_env(
        self,
        default: str = TRANSACTION,
        aliases: dict[str, str] | None = None,
        settings: dict[str, Any] | None = None,
    ) -> dict[str, str]:
        """The environment of a Django process whose ``default`` database is of mode
        ``default``, with ``aliases`` (name: mode) besides, and ``settings`` (FAST by
        default) merged into TXQUEUE."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("TXQUEUE_")}
        databases = {"default": self.database(default)}
        databases.update({name: self.database(mode) for name, mode in (aliases or {}).items()})
        env.update(
            DJANGO_SETTINGS_MODULE="tests.e2e.pgbouncer_settings",
            PYTHONPATH=str(ROOT),
            PYTHONUNBUFFERED="1",
            TXQUEUE_TEST_DB="postgresql",
            TXQUEUE_PGBOUNCER_DATABASES=json.dumps(databases),
            TXQUEUE_TEST_SETTINGS=json.dumps({**FAST, **(settings or {})}),
        )
        return env


def create_database(name: str) -> None:
    """``name`` on the suite's server, empty (dropped first if a killed run left it)."""
    _ddl(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)', f'CREATE DATABASE "{name}"')


def drop_database(name: str) -> None:
    _ddl(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _ddl(*statements: str) -> None:
    import psycopg

    host, port, user = backend()
    with psycopg.connect(host=host, port=port, user=user, dbname="postgres") as connection:
        connection.autocommit = True
        for statement in statements:
            connection.execute(statement)  # type: ignore[arg-type]


def stop_daemon(root: Path) -> None:
    """Stop the PgBouncer whose pid file is in ``root``, if it runs."""
    try:
        pid = int((root / "pgbouncer.pid").read_text().split()[0])
        # Only ours: a pid file left by a killed one may name a pid reused since.
        if str(root / "pgbouncer.ini").encode() not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return
        os.kill(pid, signal.SIGTERM)
    except (OSError, ValueError, IndexError):
        return
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            # Gone, or a zombie: the first one is the harness's child, reaped by it later.
            if Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][:1] == "Z":
                return
        except OSError:
            return
        time.sleep(0.05)


def restart(root: Path) -> None:
    """``restart_command()``'s work: stop the PgBouncer of ``root``, start it again."""
    stop_daemon(root)
    command = [str(binary()), "-d"]
    if is_root():
        command += ["-u", OS_USER]
    subprocess.run([*command, str(root / "pgbouncer.ini")], check=True, cwd=root)  # noqa: S603
    port = int(re.search(r"listen_port = (\d+)", (root / "pgbouncer.ini").read_text())[1])
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


# -- what the tests and the measurement read and run ---------------------------------


def query(bouncer: PgBouncer, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Rows of one statement on a direct connection (what an operator's psql sees)."""
    with bouncer.connect(DIRECT) as connection:
        cursor = connection.execute(sql, params)  # type: ignore[arg-type]
        return list(cursor.fetchall()) if cursor.description else []


def advisory_locks(bouncer: PgBouncer) -> list[tuple[Any, ...]]:
    """Advisory locks held on the server in the test database, by anyone."""
    return query(
        bouncer,
        "SELECT l.pid, l.objid, a.query FROM pg_locks l LEFT JOIN pg_stat_activity a "
        "ON a.pid = l.pid WHERE l.locktype = 'advisory' AND l.database = "
        "(SELECT oid FROM pg_database WHERE datname = %s)",
        (bouncer.dbname,),
    )


def registered(bouncer: PgBouncer, count: int) -> bool:
    rows = query(bouncer, "SELECT count(*) FROM django_txqueue_consumer")
    return bool(rows[0][0] >= count)


def enqueue_one_by_one(env: dict[str, str], queue: str, count: int, gap: float) -> None:
    """A producer process enqueueing ``count`` items, each committed alone, ``gap`` apart."""
    run_django(
        env,
        "shell",
        "-c",
        "import time\nfrom django_txqueue import enqueue\n"
        f"for i in range({count}):\n    enqueue({queue!r}, i)\n    time.sleep({gap})",
    )


def wake_up_delays(bouncer: PgBouncer, queue: str) -> list[float]:
    """Seconds from each item's INSERT (committed at once) to its claim, by the server's
    clock."""
    rows = query(
        bouncer,
        "SELECT EXTRACT(EPOCH FROM claimed_at - run_at)::float FROM django_txqueue_queueitem "
        "WHERE queue = %s AND claimed_at IS NOT NULL",
        (queue,),
    )
    return sorted(row[0] for row in rows)


def statuses(bouncer: PgBouncer, queue: str) -> dict[int, int]:
    rows = query(
        bouncer,
        "SELECT status, count(*) FROM django_txqueue_queueitem WHERE queue = %s GROUP BY status",
        (queue,),
    )
    return {int(status): int(n) for status, n in rows}


# -- the measurement of docs/scaling.md ------------------------------------

# name: (the consumers' connection, the producer's, other aliases, TXQUEUE settings)
SHAPES: dict[str, tuple[str, str, dict[str, str], dict[str, Any]]] = {
    "direct": (DIRECT, DIRECT, {}, {}),
    "transaction pool, LISTEN through it": (TRANSACTION, TRANSACTION, {}, {}),
    "transaction pool, LISTEN_DATABASES direct": (
        TRANSACTION,
        TRANSACTION,
        {"listen": DIRECT},
        {"LISTEN_DATABASES": {"default": "listen"}},
    ),
    "consumers on the session pool": (SESSION, TRANSACTION, {}, {}),
}


def measure(
    items: int, consumers: int, samples: int, gap: float, shapes: list[str] | None = None
) -> None:
    """Per shape: a drain of ``items`` by ``consumers`` processes (noop handler,
    --concurrency 2 --batch 10), then ``samples`` wake-ups of an idle consumer (items
    enqueued one at a time, ``gap`` seconds apart), advisory locks left, warnings."""
    import statistics

    name = "txqueue_pgbouncer_measure"
    create_database(name)
    bouncer = PgBouncer(name)
    try:
        bouncer.start()
        run_django(bouncer.child_env(DIRECT), "migrate", "--noinput", "-v", "0")
        print(
            f"{items} items, {consumers} consumers (noop, --concurrency 2 --batch 10), "
            f"POLL_INTERVAL 2 s, {samples} wake-ups {gap} s apart\n"
        )
        print("| shape | drain (items/s) | wake-up p50 | p95 | max | locks left | warnings |")
        print("|---|---|---|---|---|---|---|")
        for shape, (mode, producer, aliases, settings) in SHAPES.items():
            if shapes and shape not in shapes:
                continue
            row = _measure_shape(
                bouncer, mode, producer, aliases, settings, items, consumers, samples, gap
            )
            delays, rate, locks, warnings = row
            p50, p95 = statistics.median(delays), delays[int(0.95 * (len(delays) - 1))]
            print(
                f"| {shape} | {rate:,.0f} | {p50 * 1000:.1f} ms | {p95 * 1000:.1f} ms | "
                f"{delays[-1] * 1000:.1f} ms | {locks} | {warnings} |",
                flush=True,
            )
    finally:
        bouncer.destroy()
        drop_database(name)


def _measure_shape(
    bouncer: PgBouncer,
    mode: str,
    producer: str,
    aliases: dict[str, str],
    settings: dict[str, Any],
    items: int,
    consumers: int,
    samples: int,
    gap: float,
) -> tuple[list[float], float, int, int]:
    for table in ("django_txqueue_queueitem", "django_txqueue_consumer"):
        query(bouncer, f"DELETE FROM {table}")
    env = bouncer.child_env(
        mode,
        aliases,
        {"POLL_INTERVAL": 2, "PURGE_INTERVAL": 1, "RETENTION": 3600, **settings},
    )
    producer_env = bouncer.child_env(producer)
    logs = [bouncer.root / f"{mode}-{n}.log" for n in range(consumers)]
    command = [sys.executable, "-m", "django", "run_queue_consumer", "noop"]
    command += ["--concurrency", "2", "--batch", "10", "-v", "2"]
    running = []
    for log in logs:
        with open(log, "wb") as stderr:
            running.append(
                subprocess.Popen(  # noqa: S603 - our own command line
                    command, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr
                )
            )
    try:
        until(lambda: registered(bouncer, consumers), 30)
        time.sleep(3)  # past the first wait, and a failing LISTEN probe's 2 s
        run_django(
            producer_env,
            "shell",
            "-c",
            "from django.db import transaction\nfrom django_txqueue import enqueue_many\n"
            f"with transaction.atomic():\n    enqueue_many('noop', list(range({items})))",
        )
        until(lambda: statuses(bouncer, "noop") == {DONE: items}, 300)
        [(seconds,)] = query(
            bouncer,
            "SELECT EXTRACT(EPOCH FROM max(finished_at) - min(run_at))::float "
            "FROM django_txqueue_queueitem WHERE queue = 'noop'",
        )
        query(bouncer, "DELETE FROM django_txqueue_queueitem")
        enqueue_one_by_one(producer_env, "noop", samples, gap)
        until(lambda: statuses(bouncer, "noop") == {DONE: samples}, 60)
        delays = wake_up_delays(bouncer, "noop")
    finally:
        for process in running:
            process.send_signal(signal.SIGTERM)
        for process in running:
            process.wait(timeout=60)
    warnings = sum(log.read_text(errors="replace").count(WARNED) for log in logs)
    return delays, items / seconds, len(advisory_locks(bouncer)), warnings


def chaos(arguments: list[str]) -> None:
    """``txqueue_chaos ARGUMENTS`` with everything through the transaction pool (its
    consumers LISTEN directly, ``LISTEN_DATABASES``), purging every second; then the
    advisory locks left on the server."""
    name = "txqueue_pgbouncer_chaos_test"
    create_database(name)
    bouncer = PgBouncer(name)
    try:
        bouncer.start()
        run_django(bouncer.child_env(DIRECT), "migrate", "--noinput", "-v", "0")
        settings = {"LISTEN_DATABASES": {"default": "listen"}, "PURGE_INTERVAL": 1}
        env = bouncer.child_env(TRANSACTION, {"listen": DIRECT}, settings)
        if "--restart-pgbouncer" in arguments:
            arguments.remove("--restart-pgbouncer")
            arguments += ["--restart-command", bouncer.restart_command()]
        print(run_django(env, "txqueue_chaos", *arguments), end="")
        print(f"advisory locks left: {len(advisory_locks(bouncer))}")
    finally:
        bouncer.destroy()
        drop_database(name)


def until(condition: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout} s")
        time.sleep(0.05)


if __name__ == "__main__":
    reason = PgBouncer.missing()
    if reason:
        sys.exit(reason)
    if sys.argv[1:2] == ["measure"]:
        import argparse

        parser = argparse.ArgumentParser(prog="python -m tests.e2e.pgbouncer measure")
        parser.add_argument("--items", type=int, default=3000)
        parser.add_argument("--consumers", type=int, default=3)
        parser.add_argument("--samples", type=int, default=40)
        parser.add_argument("--gap", type=float, default=0.3)
        parser.add_argument("--shape", action="append", choices=list(SHAPES), help="(all)")
        options = parser.parse_args(sys.argv[2:])
        measure(options.items, options.consumers, options.samples, options.gap, options.shape)
        sys.exit(0)
    if sys.argv[1:2] == ["chaos"]:
        chaos(sys.argv[2:])
        sys.exit(0)
    if sys.argv[1:2] == ["restart"]:
        restart(Path(sys.argv[2]))
        sys.exit(0)
    bouncer = PgBouncer(sys.argv[1] if len(sys.argv) > 1 else "postgres")
    try:
        bouncer.start()
        for mode in (TRANSACTION, SESSION):
            print(mode, " ".join(f"{k}={v}" for k, v in bouncer.params(mode).items()))
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
    finally:
        bouncer.destroy()
