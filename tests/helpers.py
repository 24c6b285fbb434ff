"""Helpers shared by the tests: import them from here (``from tests.helpers import ...``).

conftest.py holds the fixtures only, and imports what it needs from this module.
"""

import contextlib
import datetime as dt
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from django.db import connection, connections
from django.db.models import Count
from django.utils import timezone

ROOT = Path(__file__).resolve().parent.parent


# -- what the tested database can do -----------------------------------------------------
#
# Tests that apply to some databases only say which fact they need, by name:
# ``@pytest.mark.requires("skip_locked")`` runs where the database has it,
# ``@pytest.mark.lacks("notify")`` where it has not (conftest.py skips the others), and
# ``has("update_returning")`` picks an expectation inside a test. Each fact is Django's
# (``connection.features``) or the package's (its ``Dialect``), so that a test says why it
# applies; the few that neither names are read from the vendor here, once, and say why.


@dataclass(frozen=True)
class Feature:
    says: str  # what the database has, as a skip reports it: "<database> has no <says>"
    present: Callable  # (connection) -> bool; may query the server (its version)


def _dialect(connection):
    from django_txqueue.db import dialect

    return dialect(connection)


def _update_returning(connection):
    # Django 6.0 named the fact; on 5.2 it is the vendors' own: PostgreSQL and SQLite
    # 3.35+ (which is when SQLite's INSERT ... RETURNING came too). MariaDB returns rows
    # from INSERT but not from UPDATE, MySQL from neither.
    flag = getattr(connection.features, "can_return_rows_from_update", None)
    if flag is not None:
        return flag
    return connection.features.can_return_columns_from_insert and connection.vendor != "mysql"


def _estimates(connection):
    """The dialect reads counts from the database's statistics instead of counting."""
    from django_txqueue.db import Dialect

    found = type(_dialect(connection))
    return (
        found.approximate_count is not Dialect.approximate_count
        and found.table_rows is not Dialect.table_rows
    )


def _bulk_params(connection):
    """How the dialect sends two rows of one text column to its bulk source, or None
    where rows go as VALUES."""
    found = _dialect(connection)
    column = [("a", "b")]
    layout = found.bulk_layout(connection, ["text"], column) if found.bulk_source else None
    return None if layout is None else found.bulk_params(column, layout)


FEATURES = {
    "skip_locked": Feature(
        "SELECT ... FOR UPDATE SKIP LOCKED",
        lambda c: c.features.has_select_for_update_skip_locked,
    ),
    "row_locks": Feature(
        "row locks (SELECT ... FOR UPDATE; without them one transaction writes at a time)",
        lambda c: c.features.has_select_for_update,
    ),
    "update_returning": Feature("UPDATE ... RETURNING", _update_returning),
    "partial_indexes": Feature(
        "partial indexes",
        lambda c: c.features.supports_partial_indexes,
    ),
    # MySQL's DDL, and its ANALYZE TABLE with it, commits the transaction it runs in.
    "transactional_ddl": Feature("transactional DDL", lambda c: c.features.can_rollback_ddl),
    "transaction_modes": Feature(
        "SQLite's transaction_mode option",
        lambda c: hasattr(c, "transaction_modes"),
    ),
    "notify": Feature("LISTEN/NOTIFY wake-ups", lambda c: _dialect(c).has_notify),
    "acks_while_claiming": Feature(
        "acknowledgements that ride with the next claim",
        lambda c: _dialect(c).acks_while_claiming,
    ),
    "resumes_claims": Feature(
        "claims resumed after the last item claimed", lambda c: _dialect(c).resumes_claims
    ),
    "statistics": Feature("row statistics to estimate counts from", _estimates),
    "array_bulk_rows": Feature(
        "many-row inserts from one array per column (unnest)",
        lambda c: isinstance((_bulk_params(c) or [None])[0], list),
    ),
    "json_bulk_rows": Feature(
        "many-row inserts from one JSON text (JSON_TABLE)",
        lambda c: isinstance((_bulk_params(c) or [None])[0], str),
    ),
    # Django's own fact (its MySQL backend's default storage engine): the tests that name
    # it use InnoDB's lock-wait timeout and its information_schema tables.
    "innodb": Feature(
        "InnoDB tables", lambda c: getattr(c.features, "_mysql_storage_engine", None) == "InnoDB"
    ),
    # Neither Django nor the package names it: SQLite stores a text of any length in a
    # varchar(n) column (its columns have a type affinity, not a size).
    "char_lengths": Feature(
        "column lengths enforced (a varchar(n) refuses longer text)",
        lambda c: c.vendor != "sqlite",
    ),
    # The package's: its dialect knows a lost connection from the error (a server's).
    "lost_connections": Feature(
        "connections to a server that can be lost",
        lambda c: type(_dialect(c)).is_disconnect is not _base_dialect().is_disconnect,
    ),
    # Neither names it: a PostgreSQL standby refuses writes with read_only_sql_transaction,
    # which a client left on a demoted primary meets after a failover.
    "read_only_standbys": Feature(
        "read-only standbys whose refusal counts as a lost connection",
        lambda c: c.vendor == "postgresql",
    ),
}


def _base_dialect():
    from django_txqueue.db import Dialect

    return Dialect


# SQL by which a server drops the very connection that sends it, as a server restart or a
# failover would: neither Django nor the package has it. SQLite has no server: its
# connection is closed under Django's feet instead.
DROP_OWN_CONNECTION = {
    "postgresql": "SELECT pg_terminate_backend(pg_backend_pid())",
    "mysql": "KILL CONNECTION_ID()",
}


def lose_connection(using="default"):
    """Have the server drop this thread's connection to ``using``: its next statement
    raises the vendor's lost-connection error, as after a server restart."""
    lost = connections[using]
    lost.ensure_connection()
    if lost.vendor not in DROP_OWN_CONNECTION:
        lost.connection.close()
        return
    with contextlib.suppress(Exception), lost.connection.cursor() as cursor:  # the raw one
        cursor.execute(DROP_OWN_CONNECTION[lost.vendor])


def has(feature, using="default"):
    """Whether database ``using`` has ``feature`` (a name of ``FEATURES``)."""
    return bool(FEATURES[feature].present(connections[using]))


def explain(sql, params):
    """The database's plan for ``sql``: a dict per row of its EXPLAIN, by column name.

    A plan is lines of text on PostgreSQL ("QUERY PLAN") and SQLite ("detail"); MySQL
    and MariaDB give a table of the tables read, with each one's access "type", "key"
    and "Extra"."""
    with connection.cursor() as cursor:
        cursor.execute(f"{connection.ops.explain_query_prefix()} {sql}", params)
        names = [column[0] for column in cursor.description]
        return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def item_reads(plan):
    """MySQL's table of tables read, less the claim's probe of the (empty) pause table: a
    subquery that reads no item, answered as a constant before the statement runs."""
    return [
        row
        for row in plan
        if not (
            row["select_type"] == "SUBQUERY"
            and row["table"] is None
            and "no matching row in const table" in (row["Extra"] or "")
        )
    ]


def plan_lines(plan):
    """The text of a plan of lines (``explain``), or None for MySQL's table of tables."""
    if plan and "type" in plan[0]:
        return None
    return [str(row.get("QUERY PLAN", row.get("detail"))) for row in plan]


def analyze(model):
    """Bring ``model``'s table statistics up to date, as autovacuum or InnoDB would.

    Where DDL is not transactional (``transactional_ddl``), this commits: only for tests
    with transaction=True there."""
    table = connection.ops.quote_name(model._meta.db_table)
    with connection.cursor() as cursor:
        # SQL that differs by vendor and that no Django API runs: MySQL and MariaDB spell
        # it ANALYZE TABLE, and answer with a result set.
        if connection.vendor == "mysql":
            cursor.execute(f"ANALYZE TABLE {table}")
            cursor.fetchall()
        else:
            cursor.execute(f"ANALYZE {table}")


def strategies():
    """Every claim strategy the connected database supports."""
    found = ["update_limit"]
    if connection.features.has_select_for_update_skip_locked:
        found.append("skip_locked")
    return found


def child_env():
    """Environment for a child process that must open this test database."""
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "TXQUEUE_TEST_NAME": str(connection.settings_dict["NAME"]),
        "TXQUEUE_TEST_OTHER_NAME": str(connections["other"].settings_dict["NAME"]),
        "PYTHONPATH": str(ROOT),
    }


# -- the consumer ------------------------------------------------------------------------

# Settings for consumers run by the tests: quick heartbeats, rescues and retries.
FAST = {
    "HEARTBEAT_INTERVAL": 0.1,
    "RESCUE_INTERVAL": 0.2,
    "RETRY_DELAY": 0.001,
    "RETRY_MAX_DELAY": 0.001,
    "CONSUMER_TIMEOUT": 1,
    "SHUTDOWN_TIMEOUT": 5,
}


def worker_for(*names, **options):
    """A Worker of the named queues' handlers (tests/testapp/queues.py)."""
    from django_txqueue.consumer import registry
    from django_txqueue.consumer.worker import Worker

    registry.autodiscover()
    known = registry.handlers()
    return Worker(handlers={name: known[name] for name in names}, **options)


def run_until_finished(queue_name, handle):
    """Run a consumer until every item of the queue is finished (its retries too, which
    a burst run might not wait for); the consumer."""
    from django_txqueue import Queue, Status
    from django_txqueue.consumer.worker import Worker

    worker = Worker(handlers={queue_name: handle})
    unfinished = Queue(queue_name).items.filter(status__in=(Status.READY, Status.IN_PROGRESS))
    with running(worker):
        assert wait_for(lambda: not unfinished.exists())
    return worker


@contextlib.contextmanager
def running(worker):
    """Run ``worker`` on a thread for the block; then stop it and wait for it to end."""
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        yield thread
    finally:
        worker.stop()
        thread.join(10)
    assert not thread.is_alive()


def runs_per_item():
    """``{item pk: how many times a handler ran it}``, from the handlers' Run rows."""
    from tests.testapp.models import Run

    return dict(Run.objects.values_list("item_id").annotate(n=Count("id")))


def kill_tree(process):
    """Kill ``process`` (a Popen) and its children at once, without letting it start more:
    a consumer, or a supervisor with its children each in a session of its own."""
    if process.poll() is None:
        os.kill(process.pid, signal.SIGSTOP)  # starts no more children
        for pid in child_pids(process.pid):
            os.kill(pid, signal.SIGKILL)
        process.kill()
    process.wait(timeout=10)


def child_pids(pid):
    """The pids of process ``pid``'s children."""
    if not os.path.isdir("/proc"):  # not Linux
        found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
        return [int(line) for line in found.stdout.split()]
    children = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as stat:  # "pid (comm) state ppid ..."
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            children.append(int(entry))
    return children


# -- items --------------------------------------------------------------------------------


def expire(item):
    """Move an item's lease into the past (database clock), as if time had passed."""
    from django_txqueue.models import QueueItem

    QueueItem.objects.filter(pk=item.pk).update(
        lease_expires_at=timezone.now() - dt.timedelta(seconds=5)
    )


def in_other_thread(func):
    """``func()``'s value, called in a thread of its own (its own database connection)."""
    found = []

    def run():
        try:
            found.append(func())
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=30)
    return found[0]


def wait_for(condition, timeout=10.0, interval=0.02):
    """Poll ``condition`` until it returns something truthy (returned), or return False
    after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


def finished_items(queue, n=1, *, ago, failed=False):
    """The pks of ``n`` new items of ``queue``, DONE (or FAILED) ``ago`` (a timedelta)."""
    from django_txqueue import Queue
    from django_txqueue.models import QueueItem

    Queue(queue).enqueue_many([{}] * n)
    items = Queue(queue).claim(n, pid="tests:finished")
    for item in items:
        assert item.fail("boom") if failed else item.ack()
    pks = {item.pk for item in items}
    QueueItem.objects.filter(pk__in=pks).update(finished_at=timezone.now() - ago)
    return pks
