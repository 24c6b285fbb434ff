"""The hand-written queue: the same table and queue name, a raw driver connection
(psycopg, MySQLdb or sqlite3), no Django in the loop. It is the ceiling each figure of
ours is compared with.

The one module outside ``django_txqueue.db`` with SQL of each vendor, and on purpose: a
baseline written through the queue's own dialects would measure them against
themselves. So it is what a DBA would write by hand for each database, statements and
vendor branches in full, and it writes the queue's table directly (its own queue name
only), as the figure it stands for would. The rest of the bench uses the queue's API.

Connection parameters come from Django's own (``get_connection_params()``), so the raw
connection opens exactly the database the command was pointed at. Every statement takes
the queue name, statuses and counts as parameters; only the table and index names (from
the model, quoted by the backend) are part of the SQL text.
"""

from __future__ import annotations

import json
import secrets
import select
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from django.db import connections

from django_txqueue import QueueItem, Status
from django_txqueue.db import dialect

from ..target import Target

# The columns without a database default that an INSERT must give, beyond the queue.
INSERT_COLUMNS = (
    "queue, payload, priority, status, pid, attempts, max_attempts, last_error, error_class"
)
NOTIFY_CHANNEL = "txqueue_bench_rtt"
# A project's own outbox table at its smallest (the enqueue's baseline): a key and
# the payload. The bench makes it, and drops it when done.
MINIMAL_TABLE = "txqueue_bench_minimal"
MINIMAL_COLUMNS = {
    "postgresql": "id bigserial PRIMARY KEY, payload jsonb",
    "mysql": "id bigint AUTO_INCREMENT PRIMARY KEY, payload json",
    "sqlite": "id integer PRIMARY KEY AUTOINCREMENT, payload text",
}
READY_INDEX = "txqueue_item_ready"  # QueueItem.Meta.indexes: the claim's own
# SQLite writers begin IMMEDIATE, as the test and example settings configure Django's.
BEGIN = {"postgresql": "BEGIN", "sqlite": "BEGIN IMMEDIATE"}
# The database's clock as Django's Now() reads it for each vendor.
NOW = {
    "postgresql": "STATEMENT_TIMESTAMP()",
    "mysql": "CURRENT_TIMESTAMP(6)",
    "sqlite": "STRFTIME('%Y-%m-%d %H:%M:%f', 'NOW')",  # sqlite3 binds with ?: no % escapes
}


def connect(alias: str) -> Any:
    """A raw DB-API connection to database ``alias``, in autocommit."""
    connection = connections[alias]
    params = connection.get_connection_params()
    if connection.vendor == "postgresql":
        import psycopg

        params.pop("cursor_factory", None)  # Django's cursor classes need its wrapper
        params.pop("context", None)
        return psycopg.connect(**params, autocommit=True)
    if connection.vendor == "mysql":
        import MySQLdb

        raw = MySQLdb.connect(**params)
        raw.autocommit(True)
        return raw
    import sqlite3

    return sqlite3.connect(
        params["database"], timeout=params.get("timeout", 5), isolation_level=None
    )


DEADLOCK_RETRIES = 5


def is_deadlock(exc: Exception) -> bool:
    """PostgreSQL's deadlock_detected: its loop's statements each run alone (autocommit),
    so one can be run again. (MySQL's skip_locked loop runs a transaction of several.)"""
    return getattr(exc, "sqlstate", None) == "40P01"


class RawQueue:
    """The minimal queue a DBA would write by hand for ``target``'s table and queue."""

    def __init__(self, target: Target) -> None:
        quote = target.connection.ops.quote_name
        self.target = target
        self.vendor = target.connection.vendor
        self.table = quote(QueueItem._meta.db_table)
        self.queue = target.queue
        self.index = quote(READY_INDEX)
        self.db = connect(target.alias)
        self.cursor = self.db.cursor()
        self.mark = "?" if self.vendor == "sqlite" else "%s"

    def close(self) -> None:
        self.db.close()

    def execute(self, sql: str, params: list[Any] | tuple[Any, ...] = ()) -> Any:
        if self.vendor == "sqlite":
            sql = sql.replace("%s", "?")
        # Plain ints: a driver may quote an IntEnum such as Status as a string.
        params = [int(value) if isinstance(value, Status) else value for value in params]
        for attempt in range(DEADLOCK_RETRIES):
            try:
                self.cursor.execute(sql, params)
                return self.cursor
            except Exception as exc:
                # A deadlock between two claims that wait (update_limit), or a claim and an
                # acknowledgement, rolled the statement back: run again, as any hand-written
                # loop must and as the consumer does.
                if not is_deadlock(exc) or attempt == DEADLOCK_RETRIES - 1:
                    raise
        return self.cursor

    # -- producing ---------------------------------------------------------------------

    def json_param(self) -> str:
        """A bound JSON text as the payload column takes it."""
        return "%s::jsonb" if self.vendor == "postgresql" else "%s"

    def values_row(self) -> str:
        return f"(%s, {self.json_param()}, 0, %s, '', 0, 5, '', '')"

    def make_minimal_table(self) -> None:
        """The minimal table (``MINIMAL_TABLE``), made if missing, empty."""
        self.execute(
            f"CREATE TABLE IF NOT EXISTS {MINIMAL_TABLE} ({MINIMAL_COLUMNS[self.vendor]})"
        )
        self.execute(f"DELETE FROM {MINIMAL_TABLE}")

    def drop_minimal_table(self) -> None:
        self.execute(f"DROP TABLE IF EXISTS {MINIMAL_TABLE}")

    def insert_one(self, payload: Any, *, minimal: bool = False) -> int:
        """One row in a transaction of its own, begun and committed as Django's
        ``atomic()`` does it (so both pay the same round trips); returns its id. With
        ``minimal``, into the minimal table.

        On MySQL ``atomic()`` switches autocommit off, commits and switches it on again,
        one round trip more than START TRANSACTION and COMMIT."""
        if minimal:
            sql = f"INSERT INTO {MINIMAL_TABLE} (payload) VALUES ({self.json_param()})"
            params: list[Any] = [json.dumps(payload)]
        else:
            sql = f"INSERT INTO {self.table} ({INSERT_COLUMNS}) VALUES {self.values_row()}"
            params = [self.queue, json.dumps(payload), Status.READY]
        if self.vendor == "mysql":
            self.db.autocommit(False)
            pk = int(self.execute(sql, params).lastrowid)
            self.db.commit()
            self.db.autocommit(True)
            return pk
        self.execute(BEGIN[self.vendor])
        pk = int(self.execute(f"{sql} RETURNING id", params).fetchone()[0])
        self.execute("COMMIT")
        return pk

    def insert_many(self, payloads: list[Any], *, minimal: bool = False) -> None:
        """One multi-row INSERT (with ``minimal``, into the minimal table)."""
        params: list[Any] = []
        if minimal:
            rows = ", ".join([f"({self.json_param()})"] * len(payloads))
            params = [json.dumps(payload) for payload in payloads]
            self.execute(f"INSERT INTO {MINIMAL_TABLE} (payload) VALUES {rows}", params)
            return
        rows = ", ".join([self.values_row()] * len(payloads))
        for payload in payloads:
            params += [self.queue, json.dumps(payload), Status.READY]
        self.execute(f"INSERT INTO {self.table} ({INSERT_COLUMNS}) VALUES {rows}", params)

    def insert_generated(self, count: int, status: int, keys: int = 0) -> None:
        """``count`` rows in ``status`` (READY, or DONE as if drained) made by the database
        itself: fast enough for a million-row backlog. With ``keys``, row n has key
        ``k{n % keys}`` and the round a fair queue's enqueue would give it, n // keys + 1."""
        finished = "CURRENT_TIMESTAMP" if status == Status.DONE else "NULL"
        attempts = 1 if status == Status.DONE else 0
        key, round_, key_params = "NULL", "0", []
        if keys:
            key, round_ = {
                "postgresql": ("'k' || mod(n, %s)", "n / CAST(%s AS integer) + 1"),
                "mysql": ("CONCAT('k', MOD(n, %s))", "n DIV %s + 1"),
                "sqlite": ("'k' || (n % %s)", "n / %s + 1"),
            }[self.vendor]
            key_params = [keys, keys]
        quoted_key = "`key`" if self.vendor == "mysql" else '"key"'
        columns = f"{INSERT_COLUMNS}, finished_at, {quoted_key}, round"
        values = f"%s, {{json}}, 0, %s, '', %s, 5, '', '', {finished}, {key}, {round_}"
        head = [self.queue, status, attempts, *key_params]
        if self.vendor == "postgresql":
            self.execute(
                f"INSERT INTO {self.table} ({columns}) SELECT "
                + values.format(json="jsonb_build_object('n', n)")
                + " FROM generate_series(0, %s - 1) AS n",
                [*head, count],
            )
            return
        # A recursive CTE of 1,000 numbers, crossed with itself: no deep recursion (MySQL
        # stops at 1,000 levels), one statement per 100,000 rows.
        json_n = "JSON_OBJECT('n', n)" if self.vendor == "mysql" else "json_object('n', n)"
        for start in range(0, count, 100_000):
            chunk = min(100_000, count - start)
            self.execute(
                f"INSERT INTO {self.table} ({columns}) SELECT "
                + values.format(json=json_n)
                + " FROM (WITH RECURSIVE d(k) AS (SELECT 0 UNION ALL SELECT k + 1 FROM d"
                " WHERE k < 999) SELECT %s + a.k * 1000 + b.k AS n FROM d AS a, d AS b"
                " WHERE a.k * 1000 + b.k < %s) AS numbers",
                [*head, start, chunk],
            )

    # -- consuming ---------------------------------------------------------------------

    def claim(self, batch: int, strategy: str) -> list[int]:
        """One claim of up to ``batch`` items, as one statement where the database allows."""
        if self.vendor == "postgresql":
            return self._claim_postgresql(batch, strategy)
        if self.vendor == "mysql":
            if strategy == "update_limit":
                return self._claim_mysql_update_limit(batch)
            return self._claim_mysql_skip_locked(batch)
        rows = self.execute(
            f"UPDATE {self.table} SET status = %s, pid = 'raw', attempts = attempts + 1,"
            " claimed_at = STRFTIME('%Y-%m-%d %H:%M:%f', 'NOW')"
            f" WHERE id IN (SELECT id FROM {self.table} WHERE queue = %s AND status = %s"
            " AND run_at <= STRFTIME('%Y-%m-%d %H:%M:%f', 'NOW')"
            " ORDER BY round, priority, run_at, id LIMIT %s) RETURNING id, payload",
            [Status.IN_PROGRESS, self.queue, Status.READY, batch],
        ).fetchall()
        return [row[0] for row in rows]

    def _claim_postgresql(self, batch: int, strategy: str) -> list[int]:
        lock = "FOR UPDATE SKIP LOCKED" if strategy == "skip_locked" else "FOR UPDATE"
        while True:
            rows = self.execute(
                f"WITH c AS MATERIALIZED (SELECT id FROM {self.table}"
                " WHERE queue = %s AND status = %s AND run_at <= now()"
                f" ORDER BY round, priority, run_at, id LIMIT %s {lock})"
                f" UPDATE {self.table} t SET status = %s, pid = 'raw',"
                " attempts = t.attempts + 1, claimed_at = now(),"
                " lease_expires_at = now() + interval '300 s'"
                " FROM c WHERE t.id = c.id RETURNING t.id, t.payload",
                [self.queue, Status.READY, batch, Status.IN_PROGRESS],
            ).fetchall()
            if rows or strategy == "skip_locked":
                return [row[0] for row in rows]
            # FOR UPDATE waited for a row another loop took: look again while any is left.
            left = self.execute(
                f"SELECT 1 FROM {self.table} WHERE queue = %s AND status = %s LIMIT 1",
                [self.queue, Status.READY],
            ).fetchone()
            if not left:
                return []

    def _claim_mysql_update_limit(self, batch: int) -> list[int]:
        # As a DBA would write it after EXPLAIN: without the hint MariaDB plans it on
        # another index with a filesort, locking every READY row.
        token = secrets.randbits(63)
        self.execute(
            f"UPDATE {self.table} FORCE INDEX ({self.index}) SET status = %s, pid = 'raw',"
            " claim_token = %s, attempts = attempts + 1, claimed_at = NOW(6),"
            " lease_expires_at = NOW(6) + INTERVAL 300 SECOND"
            " WHERE status = %s AND queue = %s AND run_at <= NOW(6)"
            " ORDER BY round, priority, run_at, id LIMIT %s",
            [Status.IN_PROGRESS, token, Status.READY, self.queue, batch],
        )
        if not self.cursor.rowcount:
            return []
        rows = self.execute(
            f"SELECT id, payload FROM {self.table} WHERE status = %s AND claim_token = %s",
            [Status.IN_PROGRESS, token],
        ).fetchall()
        return [row[0] for row in rows]

    def _claim_mysql_skip_locked(self, batch: int) -> list[int]:
        self.execute("START TRANSACTION")
        rows = self.execute(
            f"SELECT id, payload FROM {self.table} WHERE status = %s AND queue = %s"
            " AND run_at <= NOW(6) ORDER BY round, priority, run_at, id LIMIT %s"
            " FOR UPDATE SKIP LOCKED",
            [Status.READY, self.queue, batch],
        ).fetchall()
        ids = [row[0] for row in rows]
        if ids:
            marks = ", ".join(["%s"] * len(ids))
            self.execute(
                f"UPDATE {self.table} SET status = %s, pid = 'raw', attempts = attempts + 1,"
                " claimed_at = NOW(6), lease_expires_at = NOW(6) + INTERVAL 300 SECOND"
                f" WHERE id IN ({marks})",
                [Status.IN_PROGRESS, *ids],
            )
        self.execute("COMMIT")
        return ids

    def ack(self, ids: list[int]) -> None:
        """One UPDATE for the whole batch. ``finished_at`` to the microsecond (MySQL's
        and SQLite's CURRENT_TIMESTAMP has whole seconds): the drain's clock stops at
        the last one, as Django's ``Now()`` writes it for ours."""
        marks = ", ".join(["%s"] * len(ids))
        self.execute(
            f"UPDATE {self.table} SET status = %s, finished_at = {NOW[self.vendor]}"
            f" WHERE id IN ({marks}) AND status = %s",
            [Status.DONE, *ids, Status.IN_PROGRESS],
        )

    def drain(self, batch: int, strategy: str, ready: Callable[[], None] | None = None) -> int:
        """Claim and acknowledge until nothing is ready; returns how many items. With
        ``ready``, call it once the first batch is claimed (the drain's start line)."""
        done = 0
        ids = self.claim(batch, strategy)
        if ready is not None:
            ready()
        while ids:
            self.ack(ids)
            done += len(ids)
            ids = self.claim(batch, strategy)
        return done


# -- wake-up baselines -----------------------------------------------------------------


def paced(rounds: int, warm_up: int, gap: float) -> Iterator[bool]:
    """Yield ``warm_up + rounds`` times, ``gap`` seconds apart; True for those that count."""
    start = time.monotonic()
    for n in range(warm_up + rounds):
        time.sleep(max(0.0, start + n * gap - time.monotonic()))
        yield n >= warm_up


def notify_round_trips(alias: str, rounds: int, warm_up: int, gap: float) -> list[float]:
    """PostgreSQL: NOTIFY in autocommit on one raw connection until the other, LISTENing,
    has it (seconds each)."""
    samples = []
    notifier, listener = connect(alias), connect(alias)
    try:
        listener.execute(f"LISTEN {NOTIFY_CHANNEL}")
        pgconn = listener.pgconn
        for counted in paced(rounds, warm_up, gap):
            started = time.perf_counter()
            notifier.execute(f"NOTIFY {NOTIFY_CHANNEL}, 'x'")
            while True:
                pgconn.consume_input()
                if pgconn.notifies() is not None:
                    break
                select.select([listener.fileno()], [], [], 5)
            if counted:
                samples.append(time.perf_counter() - started)
    finally:
        notifier.close()
        listener.close()
    return samples


ECHO = """
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("127.0.0.1", 0))
print(s.getsockname()[1], flush=True)
while True:
    data, address = s.recvfrom(512)
    s.sendto(data, address)
"""


def datagram_round_trips(alias: str, rounds: int, warm_up: int, gap: float) -> list[float]:
    """MySQL/MariaDB and SQLite: a loopback UDP round trip to another process, then one
    ``SELECT 1`` on a raw connection: what a local wake-up and a claim cannot beat."""
    database = connect(alias)
    cursor = database.cursor()
    echo = subprocess.Popen([sys.executable, "-c", ECHO], stdout=subprocess.PIPE)  # noqa: S603 - our own code
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    samples = []
    try:
        port = echo.stdout.readline() if echo.stdout is not None else b""
        address = ("127.0.0.1", int(port))
        sock.settimeout(5)
        for counted in paced(rounds, warm_up, gap):
            started = time.perf_counter()
            sock.sendto(b"bench", address)
            sock.recv(512)
            cursor.execute("SELECT 1")
            cursor.fetchone()
            if counted:
                samples.append(time.perf_counter() - started)
    finally:
        sock.close()
        echo.kill()
        echo.wait()
        if echo.stdout is not None:
            echo.stdout.close()
        database.close()
    return samples


def claim_statements(target: Target, rounds: int, warm_up: int, gap: float) -> list[float]:
    """One hand-written claim of one item on a raw connection, paced like the wake-ups:
    after its wake-up a consumer must claim, so a wake-up cannot beat this either."""
    strategy = target.strategies()[0]
    target.clear()
    target.fill(warm_up + rounds)
    raw = RawQueue(target)
    samples = []
    try:
        for counted in paced(rounds, warm_up, gap):
            started = time.perf_counter()
            claimed = raw.claim(1, strategy)
            if counted:
                samples.append(time.perf_counter() - started)
            if claimed:
                raw.ack(claimed)
    finally:
        raw.close()
        target.clear()
    return samples


def wakeup_round_trips(target: Target, rounds: int, warm_up: int, gap: float) -> list[float]:
    """The bare round trips of the way our consumers are woken on ``target``'s database."""
    if dialect(target.connection).has_notify:
        return notify_round_trips(target.alias, rounds, warm_up, gap)
    return datagram_round_trips(target.alias, rounds, warm_up, gap)


def wakeup_baseline_label(target: Target) -> str:
    if dialect(target.connection).has_notify:
        return "bare LISTEN/NOTIFY round trip"
    return "bare loopback UDP round trip + SELECT 1"
