"""docs/architecture.md's rules, as far as imports do not show them (``lint-imports``
checks those): only ``db/`` holds vendor facts, only ``store/`` (and the SQL of ``db/``)
writes the queue's rows."""

import ast
import datetime as dt
import re
import traceback
from pathlib import Path

import pytest
from django.db import connection, transaction
from django.db.backends.signals import connection_created
from django.test.utils import override_settings

import django_txqueue
from django_txqueue import Queue, QueueFull, enqueue, on_commit, once
from django_txqueue.consumer import registry
from django_txqueue.consumer.worker import Worker
from django_txqueue.models import Consumer, Effect, QueueBound, QueueItem, ScheduleTick
from django_txqueue.schedule import Scheduler
from tests import walks as tests_walks
from tests.testapp import calls

from .helpers import expire, finished_items

PACKAGE = Path(django_txqueue.__file__).resolve().parent
# The one module outside db/ whose point is vendor SQL: the bench's hand-written baseline.
BASELINE = PACKAGE / "contrib" / "bench" / "raw.py"
# Reads of what a database is or has: db/ names each as a fact of its Dialect.
VENDOR_ATTRIBUTES = {"vendor", "mysql_is_mariadb", "mysql_version", "pg_version", "features"}
# A string that is a statement (not a docstring): db/ holds every one, bar those that every
# database runs alike.
STATEMENT = re.compile(
    r"\s*(SELECT|INSERT|UPDATE|DELETE|REPLACE|DO|SET|CREATE|DROP|ALTER|LOCK|PRAGMA|WITH|"
    r"EXPLAIN|ANALYZE|VACUUM|SHOW)\s"
)
PORTABLE_STATEMENTS = {"SELECT 1"}
WRITE = re.compile(r"\b(INSERT\s+INTO|UPDATE\s+\S+\s+SET|DELETE\s+FROM|REPLACE\s+INTO)\b", re.I)
WRITERS = {*(PACKAGE / "store").glob("*.py"), *(PACKAGE / "db").glob("*.py")}


def core_modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        if {"db", "migrations"} & set(path.relative_to(PACKAGE).parts) or path == BASELINE:
            continue
        yield path


def docstrings(tree):
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
    }


def vendor_facts(path):
    """``(line, name)`` of each vendor fact read in ``path``, ``connection.vendor``,
    ``connection.features`` and the like, which a named fact of db/ should stand for; and
    of each SQL statement written there (``(line, "SQL")``), which db/ should hold."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped = docstrings(tree)
    return [
        (node.lineno, node.attr)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr in VENDOR_ATTRIBUTES
    ] + [
        (node.lineno, "SQL")
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in skipped
        and STATEMENT.match(node.value)
        and node.value.strip() not in PORTABLE_STATEMENTS
    ]


def test_vendor_facts_are_read_in_db_only():
    found = {
        str(path.relative_to(PACKAGE)): facts
        for path in core_modules()
        if (facts := vendor_facts(path))
    }
    assert found == {}


def test_the_vendor_check_finds_a_vendor_branch(tmp_path):
    module = tmp_path / "branchy.py"
    module.write_text("def f(connection):\n    return connection.vendor == 'mysql'\n")
    assert vendor_facts(module) == [(2, "vendor")]


def test_the_vendor_check_finds_a_feature_read_and_a_statement(tmp_path):
    """What models.py once held: a feature read, and MySQL's no-op statement."""
    module = tmp_path / "index.py"
    module.write_text(
        '"""DO 0 in a docstring is prose."""\n'
        "def create(editor):\n"
        "    if editor.connection.features.supports_partial_indexes:\n"
        "        return None\n"
        "    return Statement('DO 0')\n"
    )
    assert sorted(vendor_facts(module)) == [(3, "features"), (5, "SQL")]


class WriteOrigins:
    """Each write to the queue's tables, by the innermost frame of the package that led
    to it; writes the tests make themselves have none and are left out."""

    def __init__(self):
        self.tables = {
            model._meta.db_table.lower()
            for model in (QueueItem, Consumer, QueueBound, Effect, ScheduleTick)
        }
        self.origins = set()

    def __call__(self, execute, sql, params, many, context):
        if WRITE.search(sql) and any(table in sql.lower() for table in self.tables):
            origin = self.origin()
            if origin is not None:
                self.origins.add(origin)
        return execute(sql, params, many, context)

    @staticmethod
    def origin():
        for frame in reversed(traceback.extract_stack()):
            path = Path(frame.filename).resolve()
            if path.is_relative_to(PACKAGE) and "migrations" not in path.parts:
                return path, frame.name
        return None

    def outside_the_store(self):
        return sorted(
            f"{path.relative_to(PACKAGE)}:{name}"
            for path, name in self.origins
            if path not in WRITERS
        )

    def install(self, sender=None, connection=None, **kwargs):
        if self not in connection.execute_wrappers:
            connection.execute_wrappers.append(self)


@pytest.fixture
def write_origins():
    """Records every thread's writes: the consumer's threads open connections of their own."""
    origins = WriteOrigins()
    origins.install(connection=connection)
    connection_created.connect(origins.install)
    yield origins
    connection_created.disconnect(origins.install)
    connection.execute_wrappers.remove(origins)


def handle(item):
    with once(f"arch-{item.pk}"):
        pass
    return {"seen": item.payload}


def test_only_the_store_writes_queue_rows(transactional_db, write_origins, settings):
    """Every way the package changes rows, from producing to purging, in one run."""
    settings.TXQUEUE = {**settings.TXQUEUE, "HEARTBEAT_INTERVAL": 0.05}
    registry.handler("arch")(handle)
    try:
        queue = Queue("arch")
        with transaction.atomic():
            enqueue("arch", {"n": 1}, dedup_key="d")
            enqueue("arch", {"n": 1}, dedup_key="d")  # the twin answers
            queue.enqueue_many([{"n": n} for n in range(2, 6)])
            on_commit(calls.record, "after commit")
        for _ in range(3):
            Queue("bounded").enqueue({})
        with pytest.raises(QueueFull):
            Queue("bounded").enqueue({})
        Queue("fair").enqueue({}, key="tenant")
        first, second, third, fourth = Queue("bounded").claim(3) + Queue("fair").claim(1)
        assert first.ack() and second.retry("again") and third.fail("no")
        assert fourth.release()
        with queue.dequeue() as item:
            assert item is not None
        [stuck] = queue.claim(1, lease=60)
        expire(stuck)
        assert queue.requeue_stuck() == 1
        assert QueueItem.objects.filter(queue="bounded").requeue() >= 1
        assert QueueItem.objects.filter(queue="fair").mark_failed("by hand") == 1
        # Periodic items: ticks recorded with their items, old tick rows trimmed.
        ticking = {"SCHEDULE": {"arch-tick": {"QUEUE": "arch", "EVERY": 1}}}
        with override_settings(TXQUEUE={**settings.TXQUEUE, **ticking}):
            scheduler = Scheduler("default")
            scheduler.since["arch-tick"] = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=15)
            scheduler.look(["arch"])
        assert ScheduleTick.objects.count() < 15
        with override_settings(TXQUEUE={**settings.TXQUEUE, "RETENTION": 0}):
            assert Worker({"arch": handle}, burst=True).run() == 0
        finished_items("arch-purged", 2, ago=dt.timedelta(days=2))
        assert Queue("arch-purged").purge(older_than=3600) == 2
        assert QueueItem.objects.filter(queue="arch", status=1).count() == 0
    finally:
        registry.unregister("arch")
    assert write_origins.origins, "no write was seen: the check itself is broken"
    assert write_origins.outside_the_store() == []


def test_the_admin_deletes_one_item_through_the_store(admin_client, write_origins):
    """The delete page of one finished item, as the changelist's bulk delete: the store's."""
    [pk] = finished_items("arch-admin", 1, ago=dt.timedelta(0))
    write_origins.origins.clear()  # the delete's writes only
    page = f"/admin/django_txqueue/queueitem/{pk}/delete/"
    assert admin_client.post(page, {"post": "yes"}).status_code == 302
    assert not QueueItem.objects.filter(pk=pk).exists()
    assert write_origins.origins, "the delete was not written by the package"
    assert write_origins.outside_the_store() == []


def test_a_write_from_another_module_is_caught(db, write_origins):
    """The check itself: a write made in a package module other than the store is named."""
    QueueItem.objects.create(queue="elsewhere", payload={})  # from a test: none of ours
    code = compile(
        "QueueItem.objects.filter(queue='elsewhere').update(priority=1)",
        str(PACKAGE / "api.py"),
        "exec",
    )
    exec(code, {"QueueItem": QueueItem})  # noqa: S102 - stands for a line of api.py
    assert write_origins.outside_the_store() == ["api.py:<module>"]


PRODUCING = {
    "api",
    "validation",
    "conf",
    "signals",
    "store",
    "store.items",
    "store.conflicts",
    "store.fairness",
    "db",
    "db.base",
    "db.inserts",
    "db.rows",
    "db.rounds",
    "db.postgresql",
    "db.mysql",
    "db.sqlite",
    "observe.tracing",
    "consumer.wakeup",
}


def test_the_walks(transactional_db, capsys):
    """docs/architecture.md's walk, as a real enqueue and a real consumer take it: an
    enqueue stays in the producing rooms; a consumer never enters the admin or the read
    side, and its loop enters each of its modules once per batch. ``-s`` prints them."""
    walks, per_batch = tests_walks.walks(), tests_walks.entries_per_batch()
    with capsys.disabled():
        for name, walk in walks.items():
            print(f"\n{name}: {len(walk.path())} modules, {len(walk.entered)} entries")
            print("  " + " > ".join(walk.path()))
        print("\nentries per batch of one item, by thread (1.0: once):")
        for (thread, name), entries in sorted(per_batch.items(), key=lambda pair: -pair[1]):
            if entries >= 0.5:
                print(f"  {thread:22} {name:28} {entries:5.2f}")
    producing = walks["enqueue"]
    assert set(producing.path()) <= PRODUCING, set(producing.path()) - PRODUCING
    assert producing.path()[0] == "api"
    assert producing.repeated() == {}
    consuming = set(walks["claim, handle, acknowledge"].path())
    assert {"consumer.worker", "consumer.settle", "store.acks", "store.claims"} <= consuming
    assert not consuming & {"admin", "observe.reads", "observe.chart", "observe.health"}
    # The loop goes one way: each thread enters each module at most once per batch (the
    # main thread claiming and settling, a handler thread running the handler); the
    # housekeeping thread's timers hardly at all.
    handed_back = {key: n for key, n in per_batch.items() if n > 1}
    assert handed_back == {}
    timers = {key: n for key, n in per_batch.items() if key[0] == "txqueue-housekeeping"}
    assert {key: n for key, n in timers.items() if n >= 0.5} == {}
