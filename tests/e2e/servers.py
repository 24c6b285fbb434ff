"""Throwaway database servers for end-to-end tests: own data directory, port and process.

The shared servers on 5432/3306 are never touched: a test that must stop and start a
database gets one of these, made in a temporary directory and removed afterwards.

- ``PostgresServer``: Debian's PostgreSQL binaries (``initdb``, ``pg_ctl``), run as the
  ``postgres`` OS user when we are root, since PostgreSQL refuses to run as root.
- ``MariaDBServer``: ``mariadb-install-db`` and ``mariadbd``, with ``--no-defaults`` so that
  the machine's ``my.cnf`` (socket, port, data directory) cannot leak in.

Each listens on 127.0.0.1 on a free port with trust/empty-password auth for its superuser
(``postgres`` / ``root``). ``restart(down)`` stops it, waits ``down`` seconds, and starts it
again on the same port and data directory. ``destroy()`` stops it by its own pid and
deletes its directory; it is safe to call more than once.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
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

    def create_database(self, name: str) -> None:
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

    def start(self) -> None:
        command = [
            self.server,
            "--no-defaults",
            f"--datadir={self.data}",
            f"--port={self.port}",
            f"--socket={self.root / 'sock'}",
            f"--pid-file={self.root / 'pid'}",
            "--bind-address=127.0.0.1",
            f"--log-error={self.log}",
            "--skip-log-bin",
            "--innodb-flush-log-at-trx-commit=0",
            "--innodb-buffer-pool-size=64M",
        ]
        if is_root():
            command.append("--user=root")
        with open(self.root / "stdout.log", "ab") as output:
            self.process = subprocess.Popen(  # noqa: S603
                command, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"mariadbd exited ({self.process.returncode}):\n{tail(self.log)}"
                )
            try:
                self.connect().close()
                return
            except Exception:  # not accepting connections yet
                time.sleep(0.1)
        raise RuntimeError(f"mariadbd on port {self.port} did not come up:\n{tail(self.log)}")

    def stop(self) -> None:
        """SIGTERM: a normal shutdown, which drops every client connection."""
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None

    def destroy(self) -> None:
        if self.process is not None:
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


SERVERS: dict[str, type[Server]] = {
    PostgresServer.vendor: PostgresServer,
    MariaDBServer.vendor: MariaDBServer,
}
