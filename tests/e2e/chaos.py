"""The full ``txqueue_chaos`` runs of docs/reliability.md, on throwaway servers.

    python -m tests.e2e.chaos postgresql|mysql|sqlite [txqueue_chaos options]

PostgreSQL and MariaDB get a server of their own (``servers.py``: a temp directory and a
spare port, never the shared servers), with ``--restart-command`` restarting it in each
round; SQLite gets a temp file, and kills only. The defaults are docs/reliability.md's full
run: 20,000 items, 4 consumers, 10 rounds. The command's live progress goes to stderr, its
report to stdout; the exit code is the command's (1 on any violation). CI runs the short
version (``test_database_restart.py``, ``tests/contrib/test_chaos.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .servers import SERVERS

ROOT = Path(__file__).resolve().parents[2]
DBNAME = "txqueue_chaos"
FULL = ["--items", "20000", "--consumers", "4", "--rounds", "10"]


def main(vendor: str, options: list[str]) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TXQUEUE_")}
    env.update(DJANGO_SETTINGS_MODULE="tests.settings", PYTHONPATH=str(ROOT))
    env["TXQUEUE_TEST_DB"] = vendor
    with tempfile.TemporaryDirectory(prefix="txqueue-chaos-") as scratch:
        server = None
        if vendor == "sqlite":
            env["TXQUEUE_TEST_NAME"] = str(Path(scratch) / "chaos.sqlite3")
            restart: list[str] = []
        else:
            server = SERVERS[vendor]()
            server.start()
            server.create_database(DBNAME)
            env.update(
                TXQUEUE_TEST_NAME=DBNAME,
                TXQUEUE_TEST_PORT=str(server.port),
                TXQUEUE_TEST_USER=server.user,
            )
            restart = ["--restart-command", server.restart_command()]
        try:

            def django(*args: str) -> int:
                command = [sys.executable, "-m", "django", *args]
                return subprocess.run(command, env=env, cwd=ROOT, check=False).returncode  # noqa: S603

            if code := django("migrate", "--noinput", "-v", "0"):
                return code
            return django("txqueue_chaos", "--yes", *FULL, *restart, *options)
        finally:
            if server is not None:
                server.destroy()


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("postgresql", "mysql", "sqlite"):
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2:]))
