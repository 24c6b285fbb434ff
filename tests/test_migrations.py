"""The migrations: in step with the models, and the queue app's alone create no table of
its optional apps (the chaos tool's table moved to ``django_txqueue.contrib.chaos``)."""

import contextlib
import json
import os
import subprocess
import sys
import uuid

import pytest
from django.core.management import call_command
from django.db import IntegrityError, connection, transaction
from django.db.migrations.executor import MigrationExecutor
from django.db.migrations.loader import MigrationLoader

from django_txqueue import Flow
from django_txqueue.models import QueueDependency, QueueFlow, QueueItem
from tests.helpers import ROOT

# Run in a child process with tests.core_settings: Django makes a fresh test database of
# its own (the suite's name with "_core"), migrates it, lists its tables and the tables
# its installed models own, and drops it.
FRESH_DATABASE = """
import json, django
django.setup()
from django.apps import apps
from django.db import connection
connection.creation.create_test_db(verbosity=0, autoclobber=True, serialize=False)
try:
    tables = connection.introspection.table_names()
finally:
    connection.creation.destroy_test_db(verbosity=0)
owned = [model._meta.db_table for model in apps.get_models(include_auto_created=True)]
print(json.dumps({"tables": tables, "owned": owned}))
"""


@pytest.mark.django_db
def test_every_app_has_the_migrations_of_its_models():
    """``makemigrations --check`` exits 1 when a model changed without a migration."""
    call_command("makemigrations", "--check", "--dry-run", verbosity=0)


def test_the_queue_apps_last_state_has_no_tool_model():
    loader = MigrationLoader(None, ignore_no_migrations=True)
    state = loader.project_state()
    models = {name for app, name in state.models if app == "django_txqueue"}
    assert "chaosrun" not in models
    assert {"queueitem", "consumer"} <= models
    chaos = state.models["txqueue_chaos", "chaosrun"]
    assert chaos.options.get("db_table") is None  # its own: txqueue_chaos_chaosrun


@pytest.mark.django_db
def test_the_chaos_table_is_the_chaos_apps_own():
    tables = connection.introspection.table_names()
    assert "txqueue_chaos_chaosrun" in tables
    assert "django_txqueue_chaosrun" not in tables


def test_a_project_with_the_queue_app_alone_gets_no_tool_table():
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.core_settings",
        "PYTHONPATH": str(ROOT),
        # A test database apart from this run's, which has the tools' apps installed.
        "TXQUEUE_TEST_RUN": os.environ.get("TXQUEUE_TEST_RUN", "") + "_core",
    }
    env.pop("TXQUEUE_TEST_NAME", None)
    done = subprocess.run(
        [sys.executable, "-c", FRESH_DATABASE],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    tables = set(found["tables"])
    assert "django_txqueue_queueitem" in tables
    assert [table for table in tables if "chaos" in table] == []
    # Every table belongs to an installed model: none left behind by a tool.
    assert tables - {"django_migrations"} <= set(found["owned"])


@contextlib.contextmanager
def migrated_back_to(node):
    """The database migrated back to ``node``: its models as they were then; migrated to
    the latest again after."""
    executor = MigrationExecutor(connection)
    executor.migrate([node])
    try:
        yield executor.loader.project_state([node]).apps
    finally:
        executor = MigrationExecutor(connection)
        executor.migrate(executor.loader.graph.leaf_nodes())


def migrate_to(node):
    MigrationExecutor(connection).migrate([node])  # the graph as the database has it now


@pytest.mark.django_db(transaction=True)
def test_0016_gives_each_item_flagged_as_waited_for_the_number_of_its_edges():
    flagged, latest = ("django_txqueue", "0015_flows"), ("django_txqueue", "0016_dependent_count")
    with migrated_back_to(flagged) as old:
        items = old.get_model("django_txqueue", "QueueItem")
        edges = old.get_model("django_txqueue", "QueueDependency")
        parent = items.objects.create(queue="q", payload={}, has_dependents=True)
        plain = items.objects.create(queue="q", payload={})
        for _ in range(2):
            child = items.objects.create(queue="q", payload={}, status=6, waiting_for=1)
            edges.objects.create(item_id=child.pk, parent_id=parent.pk)
        migrate_to(latest)
        counts = dict(
            QueueItem.objects.filter(pk__in=[parent.pk, plain.pk]).values_list(
                "pk", "dependent_count"
            )
        )
        assert counts == {parent.pk: 2, plain.pk: 0}


@pytest.mark.django_db(transaction=True)
def test_0021_keeps_every_edge_keyed_by_its_pair():
    serial, keyed = (
        ("django_txqueue", "0020_schedule"),
        ("django_txqueue", "0021_dependency_composite_key"),
    )
    with migrated_back_to(serial) as old:
        items = old.get_model("django_txqueue", "QueueItem")
        edges = old.get_model("django_txqueue", "QueueDependency")
        parents = [items.objects.create(queue="q", payload={}) for _ in range(2)]
        child = items.objects.create(queue="q", payload={}, status=6, waiting_for=2)
        for parent in parents:
            edges.objects.create(item_id=child.pk, parent_id=parent.pk)
        migrate_to(keyed)
        kept = QueueDependency.objects.filter(item_id=child.pk)
        assert sorted(kept.values_list("parent_id", flat=True)) == [p.pk for p in parents]
        assert kept.get(parent_id=parents[0].pk).pk == (parents[0].pk, child.pk)
        with pytest.raises(IntegrityError), transaction.atomic():  # the pair is the key
            QueueDependency.objects.create(item_id=child.pk, parent_id=parents[0].pk)


@pytest.mark.django_db(transaction=True)
def test_0022_records_where_each_flow_enqueued_before_it_lies():
    indexed, spans = (
        ("django_txqueue", "0021_dependency_composite_key"),
        ("django_txqueue", "0022_flow_spans"),
    )
    with migrated_back_to(indexed) as old:
        items = old.get_model("django_txqueue", "QueueItem")
        flows = [uuid.uuid4(), uuid.uuid4()]
        made = [items.objects.create(queue="q", payload={}, flow=flows[n % 2]) for n in range(5)]
        items.objects.create(queue="q", payload={})
        migrate_to(spans)
        assert {f.id: (f.first_item, f.last_item) for f in QueueFlow.objects.all()} == {
            flows[0]: (made[0].pk, made[4].pk),
            flows[1]: (made[1].pk, made[3].pk),
        }
        assert [i.pk for i in Flow.of(QueueItem.objects.get(pk=made[2].pk)).items] == [
            made[0].pk,
            made[2].pk,
            made[4].pk,
        ]
