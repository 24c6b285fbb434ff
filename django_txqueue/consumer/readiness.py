"""Whether a consumer's database is ready: reachable (waited for at start-up, before
anything needs it) and migrated.

A consumer started while its database is down (a server restart, a failover, a container
up before its database) must not exit with a traceback: under systemd's ``Restart=`` or
``--processes`` that is a crash loop. Django's system checks are the first to need the
database: field checks ask the backend for the server's version (PostgreSQL, MySQL) or
for its JSON support (SQLite). So the command waits here first, with the growing,
jittered pauses of the consumer's loop, and runs the checks after. The wait ends on a
connection that has also read the app's tables: a server that goes away again just after
it answered (a restart's shutdown under way) is waited for again, not a traceback.
"""

from __future__ import annotations

import logging
import threading
import time

from django.db import InterfaceError, OperationalError, connections

from ..observe.logs import one_line
from ..store.backoff import jittered, next_pause
from .execution import close_if_broken

logger = logging.getLogger(__name__)


class NotMigrated(Exception):
    """A database that answers but lacks some of the app's tables: a consumer would
    otherwise take a missing table for an outage and retry forever."""

    def __init__(self, alias: str, missing: list[str]) -> None:
        where = "" if alias == "default" else f" --database {alias}"
        tables = "table" if len(missing) == 1 else "tables"
        super().__init__(
            f"Database {alias!r} has no {', '.join(missing)} {tables}: "
            f"run `python manage.py migrate{where}`."
        )


def wait_for_database(
    alias: str,
    stopping: threading.Event,
    log: logging.Logger = logger,
    *,
    within: float | None = None,
) -> bool:
    """Try ``alias`` until it answers: True then, False if ``stopping`` is set first, or
    if ``within`` seconds pass first (None: no bound; a ``--burst`` run has one). Raises
    ``NotMigrated`` if it answers without the app's tables.

    Each failed try is logged on one line at WARNING. The server's version is fetched
    too: Django caches it, and the system checks need nothing more from the database.
    """
    connection = connections[alias]
    pause = 0.0
    deadline = None if within is None else time.monotonic() + within
    while not stopping.is_set() and (deadline is None or time.monotonic() < deadline):
        try:
            with connection.temporary_connection() as cursor:  # closed after, if opened here
                cursor.execute("SELECT 1")
                connection.get_database_version()
                missing = missing_tables(alias)  # on this connection, lost or not
            if missing:
                raise NotMigrated(alias, missing)
            if pause:
                log.info("database %r is available", alias)
            return True
        except (OperationalError, InterfaceError) as exc:
            close_if_broken(alias)  # one open before the wait is not reopened otherwise
            pause = next_pause(pause)
            log.warning(
                "database %r unavailable at start-up, retrying in %.1f s: %s",
                alias,
                pause,
                one_line(exc),
            )
            wait = jittered(pause)
            if deadline is not None:
                wait = min(wait, max(deadline - time.monotonic(), 0.0))
            stopping.wait(wait)
    return False


def probe(alias: str) -> tuple[str | None, list[str]]:
    """One try of database ``alias``, for a health probe (``observe/health.py``): why it
    does not answer, on one line (None when it does), and the app's tables it lacks. The
    tables are read on the one connection, so a server lost midway is an answer too."""
    try:
        return None, missing_tables(alias)
    except (OperationalError, InterfaceError) as exc:
        return one_line(exc), []


def missing_tables(alias: str) -> list[str]:
    """The app's tables that database ``alias`` does not have: not migrated (yet)."""
    from django.apps import apps

    connection = connections[alias]
    with connection.temporary_connection():
        present = set(connection.introspection.table_names())
    models = apps.get_app_config("django_txqueue").get_models()
    wanted = [model._meta.db_table for model in models if model._meta.managed]
    return sorted({table for table in wanted if table not in present})
