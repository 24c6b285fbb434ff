"""A throwaway PgBouncer in front of the suite's PostgreSQL server, for the PgBouncer tests.

Debian's ``/usr/sbin/pgbouncer`` (1.18+), its own directory, port, log and pid: started
by ``start()``, stopped by its own pid. It serves one database, ``DBNAME``, on the server
the suite runs against (``TXQUEUE_TEST_HOST``/``PORT``, the shared 127.0.0.1:5432 by
default), under two names: ``DBNAME`` in ``pool_mode=transaction`` and
``DBNAME + SESSION_SUFFIX`` in ``pool_mode=session``. Authentication is ``trust`` with a
temporary auth_file; the pools are small (``POOL_SIZE`` server connections each), as a
transaction pool is meant to be.

Django processes get ``tests.e2e.pgbouncer_settings`` through ``child_env``: the database
``default`` (through PgBouncer, or directly: ``default=``) and any other aliases named
(``aliases=``), each one of ``DIRECT``, ``TRANSACTION`` or ``SESSION``.

    python tests/e2e/pgbouncer.py

starts one and prints the two DSNs until interrupted (for trying it by hand).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .servers import FAST, ROOT, free_port, is_root, tail

BINARY = "/usr/sbin/pgbouncer"
OS_USER = "postgres"  # PgBouncer refuses to run as root: -u switches to this user
POOL_SIZE = 4
SESSION_SUFFIX = "_session"
START_TIMEOUT = 15.0

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
            f"{dbname}{SESSION_SUFFIX} = {server} pool_mode=session\n"
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
        """SIGTERM (an immediate shutdown), by its own pid."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)

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


if __name__ == "__main__":
    reason = PgBouncer.missing()
    if reason:
        sys.exit(reason)
    bouncer = PgBouncer(sys.argv[1] if len(sys.argv) > 1 else "postgres")
    try:
        bouncer.start()
        for mode in (TRANSACTION, SESSION):
            print(mode, " ".join(f"{k}={v}" for k, v in bouncer.params(mode).items()))
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
    finally:
        bouncer.destroy()
