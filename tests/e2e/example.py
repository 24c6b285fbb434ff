"""The example project, run as a user runs it: each ``manage.py`` command in a process of its
own, against a database of the example's own (not the suite's test database).

SQLite: a file in a temporary directory. PostgreSQL and MariaDB/MySQL: a database named
``test_txqueue{TXQUEUE_TEST_RUN}_example`` on the suite's server. The fixtures that make it
(``example_database``, ``example``) are in this directory's conftest.py.
"""

import json
import os
import re
import subprocess
import sys
from contextlib import contextmanager
from urllib.parse import quote

from django.conf import settings

from tests.helpers import ROOT

EXAMPLE = ROOT / "example_project"
# The suite's own server, as tests/settings.py configured it from TXQUEUE_TEST_*.
VENDOR = settings.VENDOR
SERVER = settings.DATABASES["default"]
DATABASE_NAME = f"{SERVER['TEST']['NAME']}_example"
TIMEOUT = 120  # seconds for any one command; each normally takes one or a few


# -- the example's database ----------------------------------------------------------


def server_connection():
    """An autocommit connection to the suite's server, outside any database of ours."""
    address = {"host": SERVER["HOST"], "port": int(SERVER["PORT"]), "user": SERVER["USER"]}
    if VENDOR == "postgresql":
        import psycopg

        return psycopg.connect(**address, dbname="postgres", autocommit=True)
    import MySQLdb

    connection = MySQLdb.connect(**address)
    connection.autocommit(True)
    return connection


def database_url():
    scheme = "postgres" if VENDOR == "postgresql" else "mysql"
    user, host, port = quote(SERVER["USER"]), SERVER["HOST"], SERVER["PORT"]
    return f"{scheme}://{user}@{host}:{port}/{DATABASE_NAME}"


def run_ddl(*statements):
    connection = server_connection()
    try:
        cursor = connection.cursor()
        for statement in statements:
            cursor.execute(statement)
    finally:
        connection.close()


def quoted_name():
    # DDL takes no parameters for names; this one is ours, letters, digits and _ only.
    assert re.fullmatch(r"\w+", DATABASE_NAME), DATABASE_NAME
    return f'"{DATABASE_NAME}"' if VENDOR == "postgresql" else f"`{DATABASE_NAME}`"


# -- running the example's commands --------------------------------------------------


def example_env(url, **variables):
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "cinema_site.settings",
        "CINEMA_SMS_FAIL_RATE": "0",
        "CINEMA_SMS_DELAY": "0",
        **variables,
    }
    if url is None:
        env.pop("DATABASE_URL", None)
    else:
        env["DATABASE_URL"] = url
    return env


def manage(args, env, *, check=True):
    """Run ``example_project/manage.py ARGS`` from the repository's parent directory (any
    directory works); the finished process, its output as text."""
    done = subprocess.run(
        [sys.executable, str(EXAMPLE / "manage.py"), *args],
        env=env,
        cwd=ROOT.parent,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    if check:
        assert done.returncode == 0, f"manage.py {' '.join(args)}:\n{done.stdout}{done.stderr}"
    return done


@contextmanager
def running(args, env, log):
    """``manage.py ARGS`` in the background for the ``with`` block, its output in ``log``;
    stopped afterwards with SIGTERM, as a deploy stops it, and killed if it hangs."""
    with open(log, "wb") as output:
        process = subprocess.Popen(
            [sys.executable, str(EXAMPLE / "manage.py"), *args],
            env=env,
            cwd=ROOT.parent,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=TIMEOUT / 4)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=TIMEOUT / 4)


class Example:
    """The example project on the example database, with a gateway file of this test's."""

    def __init__(self, url, gateway_path):
        self.url = url
        self.gateway_path = gateway_path

    def env(self, **variables):
        return example_env(self.url, CINEMA_SMS_GATEWAY_PATH=str(self.gateway_path), **variables)

    def manage(self, *args, check=True, **variables):
        return manage(args, self.env(**variables), check=check)

    def shell(self, code, **variables):
        """Run Python in ``manage.py shell``; what it printed."""
        return self.manage("shell", "-v", "0", "-c", code, **variables).stdout

    def running(self, *args, log, **variables):
        """``manage.py ARGS`` in the background for a ``with`` block (``running`` above)."""
        return running(args, self.env(**variables), log)

    def consume(self, **variables):
        """``run_queue_consumer sms --burst``: every SMS due now, then exit."""
        self.manage("run_queue_consumer", "sms", "--burst", "-v", "0", **variables)

    def messages(self, key):
        """The messages the gateway delivered with this idempotency key."""
        log = json.loads(self.manage("sms_log", "--json").stdout)
        return [message for message in log["messages"] if message["idempotency_key"] == key]
