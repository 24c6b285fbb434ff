"""django_txqueue.consumer.readiness: the consumer's wait for its database before the system
checks, and the check that the app's tables are there. e2e/test_startup.py starts real consumers
while a server is down.

The unreachable database here is a SQLite file in a directory that does not exist yet, as
a volume not mounted yet: every run can open one, whatever database it tests.
"""

import logging
import threading

import pytest
from django.core.management import call_command
from django.db import connection, connections

from django_txqueue.consumer.readiness import NotMigrated, missing_tables, wait_for_database
from django_txqueue.models import QueueItem
from django_txqueue.observe.logs import one_line
from tests.helpers import lose_connection


@pytest.fixture
def sqlite_alias(tmp_path, monkeypatch, django_db_blocker):
    """A database alias on ``tmp_path/volume/db.sqlite3``: unreachable until the directory
    ``tmp_path/volume`` is made. Not a test database: pytest-django lets it be opened."""
    alias = "startup"
    path = tmp_path / "volume" / "db.sqlite3"
    # Django fills in the keys left out, as it does for settings.DATABASES.
    configured = connections.configure_settings(
        {
            "default": connections.settings["default"],
            alias: {"ENGINE": "django.db.backends.sqlite3", "NAME": str(path)},
        }
    )
    monkeypatch.setitem(connections.settings, alias, configured[alias])
    with django_db_blocker.unblock():
        yield alias
    if alias in connections:
        connections[alias].close()
        del connections[alias]


class Stopping(threading.Event):
    """The consumer's stop event, recording each pause asked of it; ``then(n)`` is called
    before each, with how many pauses came before."""

    def __init__(self, then=lambda n: None):
        super().__init__()
        self.pauses = []
        self.then = then

    def wait(self, timeout=None):
        self.then(len(self.pauses))
        self.pauses.append(timeout)
        return self.is_set()


def warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_database_that_answers_is_ready_at_once(db, caplog):
    stopping = Stopping()
    with caplog.at_level(logging.INFO, logger="django_txqueue.consumer.readiness"):
        assert wait_for_database("default", stopping) is True
    assert stopping.pauses == []
    assert caplog.records == []


def test_an_unreachable_database_is_tried_with_growing_pauses_until_stopped(sqlite_alias, caplog):
    stopping = Stopping(then=lambda n: n == 3 and stopping.set())
    with caplog.at_level(logging.INFO, logger="django_txqueue.consumer.readiness"):
        assert wait_for_database(sqlite_alias, stopping) is False
    # 0.5 s doubling, each give or take 20% so that consumers that failed together spread.
    assert len(stopping.pauses) == 4
    for pause, announced in zip(stopping.pauses, (0.5, 1.0, 2.0, 4.0), strict=True):
        assert 0.8 * announced <= pause <= 1.2 * announced
    logged = warnings(caplog)
    assert logged == [
        f"database 'startup' unavailable at start-up, retrying in {announced:.1f} s: "
        "unable to open database file"
        for announced in (0.5, 1.0, 2.0, 4.0)
    ]


def mount_and_migrate(alias, volume):
    volume.mkdir()
    call_command("migrate", database=alias, verbosity=0)
    connections[alias].close()


def test_a_database_that_comes_up_ends_the_wait_and_says_so(sqlite_alias, tmp_path, caplog):
    volume = tmp_path / "volume"
    stopping = Stopping(then=lambda n: n == 1 and mount_and_migrate(sqlite_alias, volume))
    with caplog.at_level(logging.INFO, logger="django_txqueue.consumer.readiness"):
        assert wait_for_database(sqlite_alias, stopping) is True
    assert len(stopping.pauses) == 2
    assert len(warnings(caplog)) == 2
    assert caplog.records[-1].getMessage() == "database 'startup' is available"
    assert connections[sqlite_alias].connection is None  # its own connection, closed after


def test_a_server_lost_just_after_it_answered_is_waited_for_again(transactional_db, caplog):
    """A restart's shutdown can drop the connection between the ``SELECT 1`` and the read of
    the app's tables (a consumer that started then exited with a traceback): the tables are
    read in the wait, and a loss there is one more failed try."""
    if connection.vendor == "sqlite":
        pytest.skip("SQLite has no server to lose")
    connection.ensure_connection()  # open before the wait, as something may have left it
    lost = []

    def drop_before_the_tables_are_read(execute, sql, params, many, context):
        if not lost and ("pg_class" in sql or "information_schema.tables" in sql):
            lost.append(sql)
            lose_connection()
        return execute(sql, params, many, context)

    stopping = Stopping()
    with (
        connection.execute_wrapper(drop_before_the_tables_are_read),
        caplog.at_level(logging.INFO, logger="django_txqueue.consumer.readiness"),
    ):
        assert wait_for_database("default", stopping) is True
    assert len(lost) == 1 and len(stopping.pauses) == 1
    [warning] = warnings(caplog)
    assert warning.startswith("database 'default' unavailable at start-up, retrying in 0.5 s: ")
    assert caplog.records[-1].getMessage() == "database 'default' is available"


def test_a_database_that_answers_without_the_tables_is_not_waited_for(sqlite_alias, tmp_path):
    (tmp_path / "volume").mkdir()
    stopping = Stopping()
    with pytest.raises(NotMigrated, match="run `python manage.py migrate --database startup`"):
        wait_for_database(sqlite_alias, stopping)
    assert stopping.pauses == []


def test_a_consumer_stopped_before_it_starts_tries_nothing(sqlite_alias, caplog):
    stopping = Stopping()
    stopping.set()
    assert wait_for_database(sqlite_alias, stopping) is False
    assert stopping.pauses == [] and caplog.records == []


def test_one_line_joins_a_multi_line_message():
    error = OSError("connection failed: FATAL:  the database system is starting up\n\tHINT: x")
    assert (
        one_line(error) == "connection failed: FATAL: the database system is starting up HINT: x"
    )


class TestMissingTables:
    def test_none_on_a_migrated_database(self, db):
        assert missing_tables("default") == []

    def test_every_table_of_the_app_on_a_database_never_migrated(self, sqlite_alias, tmp_path):
        (tmp_path / "volume").mkdir()
        missing = missing_tables(sqlite_alias)
        assert QueueItem._meta.db_table in missing and "django_txqueue_consumer" in missing
        assert missing == sorted(missing)
        assert all(table.startswith("django_txqueue_") for table in missing)
