"""Wake-up benchmark: how soon an idle consumer starts an item after the producer's commit.

    cd /work/main
    PYTHONPATH=. DJANGO_SETTINGS_MODULE=tests.settings TXQUEUE_TEST_DB=postgresql \\
        python -m tests.bench.wakeup            # or TXQUEUE_TEST_DB=mysql / sqlite

DESIGN.md section 11, "Wake-up", measured in one run on one database:

- latency: 200 items enqueued 20 ms apart, each in its own transaction, to one real
  ``run_queue_consumer bench`` process with default settings (POLL_INTERVAL 2 s, so
  polling cannot explain a latency under 10 ms). Latency runs from the producer's commit
  (its first on_commit callback, registered before the enqueue) to the ``bench`` handler
  starting (tests/testapp/queues.py returns ``time.time()``, read back from the item's
  result). Ten warm-up items come first and are not counted.
- baseline, beside it and paced the same way (20 ms apart, so each round starts as
  cold as a wake-up does; back to back, rounds run several times faster): PostgreSQL, a
  bare LISTEN/NOTIFY round trip between two raw psycopg connections (NOTIFY in autocommit
  on one, wait on the other); MySQL/MariaDB and SQLite, a bare loopback UDP round trip to
  another process plus one plain ``SELECT 1`` on a raw driver connection. On PostgreSQL
  also, for reference, a hand-written claim statement on a raw connection: a consumer's
  wake-up cannot beat one NOTIFY plus one claim.
- the idle consumer's CPU: utime + stime from /proc/PID/stat over 10 s without work.

Targets: PostgreSQL p50 within 1.5x the bare round trip; MySQL/MariaDB and SQLite p50
under 10 ms; idle CPU under 1% of one core. It prints; it asserts nothing.

State: PostgreSQL and MySQL use their own database (TXQUEUE_BENCH_NAME, default
``txqueue_bench_wakeup``: not the drain benchmark's, since this one deletes every item and
consumer row it finds), created if missing and migrated by ``python -m django migrate``;
SQLite a temporary file in WAL mode (tests/settings.py), removed afterwards.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
VENDOR = os.environ.get("TXQUEUE_TEST_DB", "sqlite")
QUEUE = "bench"  # consumed: its handler is in tests/testapp/queues.py
RAW_QUEUE = "bench-raw"  # not consumed: the hand-written claims take from it
ITEMS = 200
ROUNDS = 200  # baseline round trips
WARM_UP = 10  # uncounted items or rounds before each measurement
GAP = 0.020  # seconds between items, and between baseline rounds
IDLE_SETTLE = 3.0  # seconds for the consumer's idle wait to grow to POLL_INTERVAL
IDLE_SAMPLE = 10.0  # seconds of idleness whose CPU time is measured
CHANNEL = "txqueue_bench_rtt"


@dataclass
class Stats:
    samples: list[float]  # seconds

    @property
    def p50(self) -> float:
        return statistics.median(self.samples)

    @property
    def p95(self) -> float:
        ordered = sorted(self.samples)
        return ordered[round(0.95 * (len(ordered) - 1))]

    @property
    def max(self) -> float:
        return max(self.samples)


def paced(rounds: int, gap: float = GAP) -> Iterator[bool]:
    """Yield WARM_UP + ``rounds`` times, ``gap`` apart; True for the rounds that count."""
    start = time.monotonic()
    for n in range(WARM_UP + rounds):
        time.sleep(max(0.0, start + n * gap - time.monotonic()))
        yield n >= WARM_UP


# -- the bench database and the consumer ---------------------------------------------


def child_env() -> dict[str, str]:
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "PYTHONPATH": str(ROOT),
        "TXQUEUE_TEST_DB": VENDOR,
    }


def prepare_database(tmp: Path) -> str:
    """Create (if missing) and migrate the bench database; return its NAME."""
    if VENDOR == "sqlite":
        name = str(tmp / "bench.sqlite3")
    else:
        name = os.environ.get("TXQUEUE_BENCH_NAME", "txqueue_bench_wakeup")
    # tests/settings.py reads this when imported: this process and its children open it.
    os.environ["TXQUEUE_TEST_NAME"] = name
    from django.conf import settings

    params: dict[str, Any] = settings.DATABASES["default"]
    if VENDOR == "postgresql":
        import psycopg

        with psycopg.connect(
            host=params["HOST"],
            port=params["PORT"],
            user=params["USER"],
            dbname="postgres",
            autocommit=True,
        ) as admin:
            exists = admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name])
            if not exists.fetchone():
                admin.execute(f'CREATE DATABASE "{name}"')
    elif VENDOR == "mysql":
        import MySQLdb

        admin = MySQLdb.connect(host=params["HOST"], port=int(params["PORT"]), user=params["USER"])
        try:
            admin.cursor().execute(f"CREATE DATABASE IF NOT EXISTS `{name}` CHARACTER SET utf8mb4")
        finally:
            admin.close()
    subprocess.run(
        [sys.executable, "-m", "django", "migrate", "-v", "0"], env=child_env(), check=True
    )
    return name


def start_consumer(log: Path) -> subprocess.Popen[bytes]:
    """A real ``run_queue_consumer bench``; returns once its Consumer row exists."""
    from django_txqueue.models import Consumer

    with log.open("wb") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "django", "run_queue_consumer", QUEUE],
            env=child_env(),
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    deadline = time.monotonic() + 20
    while not Consumer.objects.filter(os_pid=process.pid, stopped_at__isnull=True).exists():
        if process.poll() is not None or time.monotonic() > deadline:
            stop_consumer(process)
            raise SystemExit(f"the consumer did not start:\n{log.read_text()}")
        time.sleep(0.05)
    return process


def stop_consumer(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def cpu_seconds(pid: int) -> float:
    """utime + stime of all the threads of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- measurements --------------------------------------------------------------------


def wake_up_latency(count: int) -> Stats:
    """Enqueue ``count`` items GAP apart; latency = handler start - producer's commit."""
    from django.db import transaction

    from django_txqueue import enqueue
    from django_txqueue.models import QueueItem, Status

    committed: dict[int, float] = {}  # pk: when its transaction committed
    commit_time: list[float] = []
    start = time.monotonic()
    for n in range(count):
        time.sleep(max(0.0, start + n * GAP - time.monotonic()))
        with transaction.atomic():
            # Registered first, so it runs first after COMMIT: before the enqueue's own
            # on_commit work (the local wake-up datagram), which thus counts as latency.
            transaction.on_commit(lambda: commit_time.append(time.time()))
            item = enqueue(QUEUE, n)
        committed[item.pk] = commit_time.pop()
    items = QueueItem.objects.filter(pk__in=committed)
    deadline = time.monotonic() + 15
    while (done := items.filter(status=Status.DONE).count()) < count:
        if time.monotonic() > deadline:
            raise SystemExit(f"only {done} of {count} items done in time")
        time.sleep(0.05)
    started: dict[int, float] = dict(items.values_list("pk", "result"))  # type: ignore[arg-type]
    return Stats([started[pk] - committed[pk] for pk in committed])


def raw_connection_params() -> dict[str, Any]:
    from django.db import connection

    params = connection.get_connection_params()
    params.pop("cursor_factory", None)  # Django's psycopg cursor classes need its wrapper
    params.pop("context", None)
    return params


def notify_round_trips(rounds: int, pace: bool = True) -> Stats:
    """NOTIFY in autocommit on one raw connection until the other, LISTENing, has it."""
    import psycopg

    samples = []
    with (
        psycopg.connect(**raw_connection_params(), autocommit=True) as notifier,
        psycopg.connect(**raw_connection_params(), autocommit=True) as listener,
    ):
        listener.execute(f"LISTEN {CHANNEL}")
        pgconn = listener.pgconn
        for counted in paced(rounds, GAP if pace else 0.0):
            started = time.perf_counter()
            notifier.execute(f"NOTIFY {CHANNEL}, 'x'")
            while True:
                pgconn.consume_input()
                if pgconn.notifies() is not None:
                    break
                select.select([listener.fileno()], [], [], 5)
            if counted:
                samples.append(time.perf_counter() - started)
    return Stats(samples)


def hand_written_claims(rounds: int) -> Stats:
    """One SKIP LOCKED claim statement in autocommit on a raw psycopg connection."""
    import psycopg

    from django_txqueue import Queue
    from django_txqueue.models import QueueItem, Status

    Queue(RAW_QUEUE).enqueue_many(list(range(WARM_UP + rounds)))
    table = QueueItem._meta.db_table
    claim = f"""
        WITH picked AS MATERIALIZED (
            SELECT id FROM {table}
            WHERE queue = %s AND status = {Status.READY:d} AND run_at <= statement_timestamp()
            ORDER BY priority, run_at, id LIMIT 1 FOR UPDATE SKIP LOCKED)
        UPDATE {table} AS item SET status = {Status.IN_PROGRESS:d}, pid = %s,
            claim_token = %s, attempts = item.attempts + 1, claimed_at = statement_timestamp(),
            lease_expires_at = statement_timestamp() + interval '300 seconds'
        FROM picked WHERE item.id = picked.id RETURNING item.*"""
    samples = []
    with psycopg.connect(**raw_connection_params(), autocommit=True) as raw:
        for token, counted in enumerate(paced(rounds)):
            started = time.perf_counter()
            rows = raw.execute(claim, [RAW_QUEUE, "bench", token]).fetchall()
            if counted:
                samples.append(time.perf_counter() - started)
            assert len(rows) == 1
    return Stats(samples)


ECHO = """
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("127.0.0.1", 0))
print(s.getsockname()[1], flush=True)
while True:
    data, address = s.recvfrom(512)
    s.sendto(data, address)
"""


def local_round_trips(rounds: int) -> tuple[Stats, Stats, Stats]:
    """A loopback UDP round trip to another process, then a raw ``SELECT 1``: both, each."""
    from django.db import connection

    if VENDOR == "sqlite":
        import sqlite3

        database = sqlite3.connect(connection.settings_dict["NAME"])
    else:
        import MySQLdb

        database = MySQLdb.connect(**raw_connection_params())
    cursor = database.cursor()
    echo = subprocess.Popen([sys.executable, "-c", ECHO], stdout=subprocess.PIPE)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        assert echo.stdout is not None
        address = ("127.0.0.1", int(echo.stdout.readline()))
        sock.settimeout(5)
        both, udp, query = [], [], []
        for counted in paced(rounds):
            started = time.perf_counter()
            sock.sendto(QUEUE.encode(), address)
            sock.recv(512)
            echoed = time.perf_counter()
            cursor.execute("SELECT 1")
            cursor.fetchone()
            done = time.perf_counter()
            if counted:
                both.append(done - started)
                udp.append(echoed - started)
                query.append(done - echoed)
    finally:
        sock.close()
        echo.kill()
        echo.wait()
        database.close()
    return Stats(both), Stats(udp), Stats(query)


# -- report --------------------------------------------------------------------------


def row(label: str, stats: Stats, target: str = "", verdict: str = "") -> str:
    numbers = " ".join(f"{value * 1000:7.2f} ms" for value in (stats.p50, stats.p95, stats.max))
    return f"{label:<48} {numbers}   {target:<27} {verdict}".rstrip()


def server_version() -> str:
    from django.db import connection

    if VENDOR == "sqlite":
        import sqlite3

        with connection.cursor() as cursor:
            cursor.execute("PRAGMA journal_mode")
            return f"{sqlite3.sqlite_version}, journal_mode {cursor.fetchone()[0]}"
    with connection.cursor() as cursor:
        cursor.execute("SHOW server_version" if VENDOR == "postgresql" else "SELECT version()")
        return str(cursor.fetchone()[0]).split()[0]


def main() -> None:
    import django

    began = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="txqueue-bench-"))
    process = None
    try:
        name = prepare_database(tmp)
        django.setup()
        from django.db import connection, connections

        from django_txqueue import conf
        from django_txqueue.models import Consumer, QueueItem

        QueueItem.objects.all().delete()
        Consumer.objects.all().delete()
        process = start_consumer(tmp / "consumer.log")
        wake_up_latency(WARM_UP)
        extra: list[tuple[str, Stats]] = []
        if VENDOR == "postgresql":
            baseline = notify_round_trips(ROUNDS)
            baseline_label = "bare LISTEN/NOTIFY round trip"
            extra.append(("  the same, back to back", notify_round_trips(ROUNDS, pace=False)))
            extra.append(("hand-written claim, raw psycopg", hand_written_claims(ROUNDS)))
            limit = 1.5 * baseline.p50
            target = f"p50 <= 1.5 x bare = {limit * 1000:.2f} ms"
        else:
            baseline, udp, query = local_round_trips(ROUNDS)
            baseline_label = "bare UDP round trip + SELECT 1"
            extra += [("  of which the UDP round trip", udp), ("  of which SELECT 1", query)]
            limit = 0.010
            target = "p50 < 10 ms"
        latency = wake_up_latency(ITEMS)
        time.sleep(IDLE_SETTLE)
        cpu_then, clock_then = cpu_seconds(process.pid), time.monotonic()
        time.sleep(IDLE_SAMPLE)
        cpu = (cpu_seconds(process.pid) - cpu_then) / (time.monotonic() - clock_then)

        load = ", ".join(f"{n:.2f}" for n in os.getloadavg())
        print(
            f"\n{connection.display_name} {server_version()}, database {name}; "
            f"POLL_INTERVAL {conf.get('POLL_INTERVAL')} s; {os.cpu_count()} CPUs, "
            f"load average {load}"
        )
        print(f"{'':<48} {'p50':>10} {'p95':>10} {'max':>10}   target")
        verdict = "OK" if latency.p50 <= limit else "MISSED"
        print(row(f"wake-up latency, commit -> handler (n={ITEMS})", latency, target, verdict))
        print(row(f"{baseline_label} (n={ROUNDS})", baseline))
        for label, stats in extra:
            print(row(label, stats))
        tick = 100 / os.sysconf("SC_CLK_TCK") / IDLE_SAMPLE  # the resolution, in %
        cpu_cell = f"{cpu * 100:8.2f} % ±{tick:.2f} over {IDLE_SAMPLE:.0f} s idle"
        print(
            f"{'idle consumer CPU':<48} {cpu_cell:<32}   {'< 1 %':<27} "
            f"{'OK' if cpu < 0.01 else 'MISSED'}"
        )
        print(f"({time.monotonic() - began:.0f} s; items and rounds {GAP * 1000:.0f} ms apart)")
        connections.close_all()
    finally:
        if process is not None:
            stop_consumer(process)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
