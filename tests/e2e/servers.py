"""Throwaway database servers for end-to-end tests: own data directory, port and process.

The shared servers on 5432/3306 are never touched: a test that must stop and start a
database gets one of these, made in a temporary directory and removed afterwards.

- ``PostgresServer``: Debian's PostgreSQL binaries (``initdb``, ``pg_ctl``), run as the
  ``postgres`` OS user when we are root, since PostgreSQL refuses to run as root.
- ``MariaDBServer``: ``mariadb-install-db`` and ``mariadbd``, with ``--no-defaults`` so that
  the machine's ``my.cnf`` (socket, port, data directory) cannot leak in.

Each listens on 127.0.0.1 on a free port with trust/empty-password auth for its superuser
(``postgres`` / ``root``). ``restart(down)`` stops it, waits ``down`` seconds, and starts it
again on the same port and data directory; ``restart_command()`` is a shell command that
does the same from another process (``txqueue_chaos --restart-command``). ``destroy()``
stops it by its own pid and deletes its directory; it is safe to call more than once.

    python tests/e2e/servers.py restart DIRECTORY

restarts the MariaDB server made in DIRECTORY (what its ``restart_command()`` runs).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import pwd
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

START_TIMEOUT = 30.0


def free_port() -> int:
    """A TCP port on the loopback that nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def is_root() -> bool:
    return os.geteuid() == 0


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no {path})"


class Server:
    """What the tests use: a vendor name, a port, a superuser, raw queries."""

    vendor: str  # the TXQUEUE_TEST_DB value for this server
    user: str
    root: Path
    port: int

    @classmethod
    def missing(cls) -> str | None:
        """Why this kind of server cannot be started here, or None."""
        raise NotImplementedError

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def destroy(self) -> None:
        raise NotImplementedError

    def connect(self, dbname: str | None = None) -> Any:
        raise NotImplementedError

    def restart(self, down: float) -> None:
        """Stop the server, stay down ``down`` seconds, start it again (same port, data)."""
        self.stop()
        time.sleep(down)
        self.start()

    def restart_command(self) -> str:
        """A shell command that restarts the server from another process, returning once
        it accepts connections again."""
        raise NotImplementedError

    def create_database(self, name: str) -> None:
        raise NotImplementedError

    def decode_json(self, value: Any) -> Any:
        """A JSON column's value as ``query`` returns it (this driver's raw answer), decoded."""
        raise NotImplementedError

    def query(self, dbname: str, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        """Rows of one statement (none for DDL/DML), on a fresh autocommit connection."""
        connection = self.connect(dbname)
        try:
            cursor = connection.cursor()
            cursor.execute(sql, params)
            rows = list(cursor.fetchall()) if cursor.description else []
            cursor.close()
            return rows
        finally:
            connection.close()

    def wait_until_up(self, deadline: float) -> None:
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                self.connect().close()
                return
            except Exception as exc:  # not accepting connections yet
                last = exc
                time.sleep(0.1)
        raise RuntimeError(f"{type(self).__name__} on port {self.port} did not come up: {last}")


# -- PostgreSQL ------------------------------------------------------------------------


def postgres_bindir() -> Path | None:
    """Debian's versioned bin directory, PostgreSQL 15 preferred, else the newest found."""
    preferred = Path("/usr/lib/postgresql/15/bin")
    if (preferred / "pg_ctl").exists():
        return preferred
    found = sorted(
        (Path(p).parent for p in glob.glob("/usr/lib/postgresql/*/bin/pg_ctl")),
        key=lambda path: int(path.parent.name) if path.parent.name.isdigit() else 0,
    )
    if found:
        return found[-1]
    pg_ctl = shutil.which("pg_ctl")
    return Path(pg_ctl).parent if pg_ctl else None


class PostgresServer(Server):
    vendor = "postgresql"
    user = "postgres"
    OS_USER = "postgres"

    @classmethod
    def missing(cls) -> str | None:
        bindir = postgres_bindir()
        if bindir is None or not (bindir / "initdb").exists():
            return "no PostgreSQL server binaries (initdb, pg_ctl under /usr/lib/postgresql/*/bin)"
        if is_root():
            try:
                pwd.getpwnam(cls.OS_USER)
            except KeyError:
                return f"running as root and no {cls.OS_USER!r} OS user to run PostgreSQL as"
            if shutil.which("runuser") is None:
                return "running as root and no runuser to run PostgreSQL as another user"
        try:
            import psycopg  # noqa: F401
        except ImportError:
            return "psycopg is not installed"
        return None

    def __init__(self) -> None:
        bindir = postgres_bindir()
        assert bindir is not None, self.missing()
        self.bindir = bindir
        # Not pytest's tmp_path: its parents are private to root, and the server runs as
        # the postgres user, who must be able to reach its data directory.
        self.root = Path(tempfile.mkdtemp(prefix="txqueue-e2e-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.port = free_port()
        if is_root():
            entry = pwd.getpwnam(self.OS_USER)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
        self._run(
            "initdb",
            "-D",
            str(self.data),
            "-U",
            self.user,
            "--auth=trust",
            "--encoding=UTF8",
            "--no-sync",
        )

    def _run(self, program: str, *args: str, timeout: float = 60) -> None:
        command = [str(self.bindir / program), *args]
        if is_root():
            command = ["runuser", "-u", self.OS_USER, "--", *command]
        done = subprocess.run(  # noqa: S603
            command,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=self.root,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"{program} failed ({done.returncode}): {done.stdout}{done.stderr}\n"
                f"server log:\n{tail(self.log)}"
            )

    def start(self) -> None:
        options = (
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 "
            "-c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        )
        # -l: the postmaster outlives pg_ctl, so its output must not go to our pipes.
        self._run(
            "pg_ctl",
            "-D",
            str(self.data),
            "-l",
            str(self.log),
            "-o",
            options,
            "-w",
            "-t",
            str(int(START_TIMEOUT)),
            "start",
        )
        self.wait_until_up(time.monotonic() + START_TIMEOUT)

    def stop(self, mode: str = "fast") -> None:
        """``fast``: clients are disconnected at once, as in a routine server restart."""
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "30", "stop")

    def restart_command(self) -> str:
        # pg_ctl restart keeps the options it was started with; -l keeps the postmaster's
        # output off the caller's pipes.
        command = [str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l", str(self.log)]
        command += ["-m", "fast", "-w", "-t", "30", "restart"]
        if is_root():
            command = ["runuser", "-u", self.OS_USER, "--", *command]
        return shlex.join(command)

    def pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def destroy(self) -> None:
        if self.pid() is not None:
            try:
                self.stop("immediate")
            except (RuntimeError, subprocess.TimeoutExpired):
                pid = self.pid()
                if pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                    time.sleep(0.5)
        shutil.rmtree(self.root, ignore_errors=True)

    def connect(self, dbname: str | None = None) -> Any:
        import psycopg

        return psycopg.connect(
            host="127.0.0.1",
            port=self.port,
            user=self.user,
            dbname=dbname or "postgres",
            autocommit=True,
            connect_timeout=5,
        )

    def create_database(self, name: str) -> None:
        connection = self.connect()
        try:
            connection.execute(f'CREATE DATABASE "{name}"')
        finally:
            connection.close()

    def decode_json(self, value: Any) -> Any:
        return value  # psycopg decodes jsonb itself


# -- MariaDB ---------------------------------------------------------------------------


class MariaDBServer(Server):
    vendor = "mysql"
    user = "root"

    @staticmethod
    def binaries() -> tuple[str | None, str | None]:
        server = (
            shutil.which("mariadbd")
            or shutil.which("mariadbd", path="/usr/sbin:/usr/local/sbin")
            or shutil.which("mysqld", path="/usr/sbin:/usr/local/sbin")
        )
        install = shutil.which("mariadb-install-db") or shutil.which("mysql_install_db")
        return server, install

    @classmethod
    def missing(cls) -> str | None:
        server, install = cls.binaries()
        if server is None or install is None:
            return "no MariaDB server binaries (mariadbd and mariadb-install-db)"
        try:
            import MySQLdb  # noqa: F401
        except ImportError:
            return "mysqlclient (MySQLdb) is not installed"
        return None

    def __init__(self) -> None:
        server, install = self.binaries()
        assert server is not None and install is not None, self.missing()
        self.server = server
        self.root = Path(tempfile.mkdtemp(prefix="txqueue-e2e-mariadb-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        command = [
            install,
            "--no-defaults",
            f"--datadir={self.data}",
            "--auth-root-authentication-method=normal",
            "--skip-test-db",
        ]
        if is_root():
            command.append("--user=root")
        done = subprocess.run(  # noqa: S603
            command, capture_output=True, text=True, timeout=120, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"mariadb-install-db failed: {done.stdout}{done.stderr}")

    def start_command(self) -> list[str]:
        command = [
            self.server,
            "--no-defaults",
            f"--datadir={self.data}",
            f"--port={self.port}",
            f"--socket={self.root / 'sock'}",
            f"--pid-file={self.pid_file}",
            "--bind-address=127.0.0.1",
            f"--log-error={self.log}",
            "--skip-log-bin",
            "--innodb-flush-log-at-trx-commit=0",
            "--innodb-buffer-pool-size=64M",
        ]
        if is_root():
            command.append("--user=root")
        return command

    @property
    def pid_file(self) -> Path:
        return self.root / "pid"

    def start(self) -> None:
        # What ``servers.py restart`` needs to start it again.
        (self.root / "server.json").write_text(
            json.dumps({"command": self.start_command(), "port": self.port})
        )
        self.process = launch(self.root, self.start_command())
        wait_for_mariadb(self.root, self.port, self.process)

    def stop(self) -> None:
        """SIGTERM: a normal shutdown, which drops every client connection. By the pid
        file, since a restart command may have started the running server."""
        stop_mariadb(self.root)
        if self.process is not None:
            self.process.wait(timeout=10)  # reaped, if it was ours
            self.process = None

    def restart_command(self) -> str:
        return shlex.join([sys.executable, __file__, "restart", str(self.root)])

    def destroy(self) -> None:
        pid = read_pid(self.pid_file)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
            self.process.wait(timeout=10)
            self.process = None
        shutil.rmtree(self.root, ignore_errors=True)

    def connect(self, dbname: str | None = None) -> Any:
        import MySQLdb

        connection = MySQLdb.connect(
            host="127.0.0.1",
            port=self.port,
            user=self.user,
            database=dbname or "",
            connect_timeout=5,
            charset="utf8mb4",
        )
        connection.autocommit(True)
        return connection

    def create_database(self, name: str) -> None:
        self.query("", f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4")

    def decode_json(self, value: Any) -> Any:
        return json.loads(value)  # a JSON column is text here (LONGTEXT)


def read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def launch(root: Path, command: list[str]) -> subprocess.Popen[bytes]:
    """mariadbd in a session of its own, its output appended to ``root/stdout.log``."""
    with open(root / "stdout.log", "ab") as output:
        return subprocess.Popen(  # noqa: S603
            command, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )


def wait_for_mariadb(root: Path, port: int, process: subprocess.Popen[bytes]) -> None:
    import MySQLdb

    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"mariadbd exited ({process.returncode}):\n{tail(root / 'server.log')}"
            )
        try:
            MySQLdb.connect(host="127.0.0.1", port=port, user="root", connect_timeout=5).close()
            return
        except MySQLdb.OperationalError:  # not accepting connections yet
            time.sleep(0.1)
    raise RuntimeError(f"mariadbd on port {port} did not come up:\n{tail(root / 'server.log')}")


def stop_mariadb(root: Path) -> None:
    """SIGTERM the server of ``root`` by its pid file; wait until the file is gone (mariadbd
    removes it last, once shut down: the pid itself may linger as a zombie of whoever
    started it), SIGKILL after 30 s."""
    pid_file = root / "pid"
    pid = read_pid(pid_file)
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    if pid_file.exists():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
        pid_file.unlink(missing_ok=True)


def restart_mariadb(root: Path) -> None:
    """Stop the server of ``root`` and start it again, detached, as it was started."""
    started = json.loads((root / "server.json").read_text())
    stop_mariadb(root)
    wait_for_mariadb(root, started["port"], launch(root, started["command"]))


SERVERS: dict[str, type[Server]] = {
    PostgresServer.vendor: PostgresServer,
    MariaDBServer.vendor: MariaDBServer,
}


# -- Django processes on a throwaway server ------------------------------------------------
#
# test_database_restart.py and test_startup.py run ``python -m django`` against the
# database DBNAME of a throwaway server (conftest.py's ``server`` fixture makes it), and
# read it back through ``Server.query``.

ROOT = Path(__file__).resolve().parents[2]
DBNAME = "txqueue_e2e"
READY, IN_PROGRESS, DONE, FAILED = 1, 2, 3, 4
# A consumer's settings there: quick heartbeats, polls, rescues and retries.
FAST = {
    "HEARTBEAT_INTERVAL": 0.2,
    "POLL_INTERVAL": 0.2,
    "RESCUE_INTERVAL": 1,
    "CONSUMER_TIMEOUT": 5,
    "RETRY_DELAY": 0.5,
    "RETRY_MAX_DELAY": 1,
    "LEASE": 10,
}


def child_env(server: Server, settings: dict[str, Any] | None = None) -> dict[str, str]:
    """A Django process on the throwaway server's test database, whatever this run uses."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TXQUEUE_")}
    env.update(
        DJANGO_SETTINGS_MODULE="tests.settings",
        PYTHONPATH=str(ROOT),
        PYTHONUNBUFFERED="1",
        TXQUEUE_TEST_DB=server.vendor,
        TXQUEUE_TEST_HOST="127.0.0.1",
        TXQUEUE_TEST_PORT=str(server.port),
        TXQUEUE_TEST_USER=server.user,
        TXQUEUE_TEST_NAME=DBNAME,
        TXQUEUE_TEST_SETTINGS=json.dumps(settings or FAST),
    )
    return env


def django(server: Server, *args: str) -> str:
    return run_django(child_env(server), *args)


def run_django(env: dict[str, str], *args: str, timeout: float = 120) -> str:
    """``python -m django ARGS`` in a child process with ``env``; its output."""
    done = subprocess.run(
        [sys.executable, "-m", "django", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, f"django {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def enqueue(server: Server, queue: str, payloads: str) -> None:
    """``payloads``: a Python expression for the list, evaluated in the child."""
    django(
        server,
        "shell",
        "-c",
        f"from django_txqueue import enqueue_many; enqueue_many({queue!r}, {payloads})",
    )


def counts(server: Server, queue: str) -> dict[int, int]:
    rows = server.query(
        DBNAME,
        "SELECT status, COUNT(*) FROM django_txqueue_queueitem WHERE queue = %s GROUP BY status",
        (queue,),
    )
    return {int(status): int(n) for status, n in rows}


def needs_servers(vendor: str, missing: str | None, what: str) -> None:
    """Skip unless this is the suite run of ``vendor`` (``TXQUEUE_TEST_DB``), so that CI's
    passes do not repeat the test; then skip for ``missing`` server binaries (the reason,
    or None), except under ``CI=true``, where missing them fails ``what``."""
    import pytest

    current = os.environ.get("TXQUEUE_TEST_DB", "sqlite")
    if current != vendor:
        pytest.skip(f"runs with TXQUEUE_TEST_DB={vendor} (this run: {current})")
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run {what}: {missing}")
        pytest.skip(missing)


def wait_for(condition, timeout: float, what: str, running=None, interval: float = 0.05):
    """Poll ``condition`` until true; fail at once if the ``running`` consumer exits."""
    import pytest

    deadline = time.monotonic() + timeout
    while True:
        if running is not None:
            running.assert_alive()
        try:
            value = condition()
        except Exception:  # the server may still be refusing connections
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


if __name__ == "__main__":
    if sys.argv[1:2] != ["restart"] or len(sys.argv) != 3:
        sys.exit("usage: python tests/e2e/servers.py restart DIRECTORY")
    restart_mariadb(Path(sys.argv[2]))
