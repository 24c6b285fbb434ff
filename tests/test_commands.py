"""The commands: run_queue_consumer's arguments, and the maintenance commands
txqueue_stats, txqueue_requeue_stuck and txqueue_purge."""

import contextlib
import datetime as dt
import io
import json
import os
import re
import subprocess
import sys
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError, SystemCheckError
from django.db import connection
from django.utils import timezone

from django_txqueue import Queue, Status, enqueue, once
from django_txqueue.consumer import registry
from django_txqueue.models import Consumer, Effect, QueueItem
from django_txqueue.tasks.backend import TASKS_FRAMEWORK
from tests.helpers import child_env


@contextlib.contextmanager
def empty_database(tmp_path):
    """The name of a database of the tested kind with no tables, dropped afterwards."""
    if os.path.isabs(str(connection.settings_dict["NAME"])):
        # A database named by its file (SQLite): a new one is a new path.
        yield str(tmp_path / "empty.sqlite3")
        return
    name = f"txqueue_empty_{os.getpid()}"
    quoted = connection.ops.quote_name(name)
    # A connection to no database of ours, as Django's own test database creation opens.
    with connection._nodb_cursor() as cursor:
        cursor.execute(f"CREATE DATABASE {quoted}")
    try:
        yield name
    finally:
        with connection._nodb_cursor() as cursor:
            cursor.execute(f"DROP DATABASE IF EXISTS {quoted}")


def run(*args, **options):
    out = io.StringIO()
    call_command(*args, stdout=out, no_color=True, **options)
    return out.getvalue()


def parse_table(output):
    """{queue: {column title: cell}} from the aligned table (columns: 2+ spaces apart)."""
    header, *rows = (re.split(r"\s{2,}", line.strip()) for line in output.strip().splitlines())
    assert header == [
        "queue",
        "ready",
        "in progress",
        "waiting",
        "done",
        "failed",
        "cancelled",
        "stuck",
        "oldest ready age (s)",
    ]
    assert all(len(row) == len(header) for row in rows)
    return {row[0]: dict(zip(header[1:], row[1:], strict=True)) for row in rows}


def numbers(row):
    return {title: float(cell) for title, cell in row.items()}


def expire(items):
    """Move the items' leases into the past, as if their consumer had hung."""
    QueueItem.objects.filter(pk__in=[i.pk for i in items]).update(
        lease_expires_at=timezone.now() - dt.timedelta(seconds=5)
    )


def finished_ago(items, **ago):
    QueueItem.objects.filter(pk__in=[i.pk for i in items]).update(
        finished_at=timezone.now() - dt.timedelta(**ago)
    )


@pytest.fixture
def two_queues(db):
    """alpha: 2 ready (due for an hour), 1 in progress and stuck, 1 done, 1 failed.
    beta: 1 ready but not yet due."""
    alpha = Queue("alpha")
    alpha.enqueue_many([{"n": n} for n in range(3)])
    hung, done, failed = alpha.claim(3)
    assert done.ack() and failed.fail("boom")
    expire([hung])
    alpha.enqueue_many([{"n": n} for n in (3, 4)], run_at=timezone.now() - dt.timedelta(hours=1))
    Queue("beta").enqueue({"n": 5}, delay=3600)
    return alpha


class TestStats:
    @pytest.fixture(autouse=True)
    def no_configured_queues(self, settings):
        settings.TXQUEUE = {"QUEUES": {}}

    def test_configured_queues_show_with_zeros_before_their_first_item(self, two_queues, settings):
        settings.TXQUEUE = {"QUEUES": {"emails": {"LEASE": 5}, "beta": {}}}
        table = parse_table(run("txqueue_stats"))
        assert list(table) == ["alpha", "beta", "emails"]
        assert set(numbers(table["emails"]).values()) == {0.0}
        assert numbers(table["beta"])["ready"] == 1
        stats = json.loads(run("txqueue_stats", "--json"))
        assert [s["queue"] for s in stats] == ["alpha", "beta", "emails"]
        # Placed on the other database: shown there, not on the default one.
        settings.TXQUEUE = {"QUEUES": {"emails": {"DATABASE": "other"}}}
        assert list(parse_table(run("txqueue_stats", database="default"))) == ["alpha", "beta"]

    def test_table_of_every_queue_with_items(self, two_queues):
        table = parse_table(run("txqueue_stats"))
        assert list(table) == ["alpha", "beta"]
        alpha = numbers(table["alpha"])
        age = alpha.pop("oldest ready age (s)")
        assert alpha == {
            "ready": 2,
            "in progress": 1,
            "waiting": 0,
            "done": 1,
            "failed": 1,
            "cancelled": 0,
            "stuck": 1,
        }
        assert 3590 <= age <= 3700
        assert re.fullmatch(r"\d+\.\d", table["alpha"]["oldest ready age (s)"])
        assert numbers(table["beta"]) == {
            "ready": 1,
            "in progress": 0,
            "waiting": 0,
            "done": 0,
            "failed": 0,
            "cancelled": 0,
            "stuck": 0,
            "oldest ready age (s)": 0.0,
        }

    def test_named_queues_only_even_empty_ones(self, two_queues):
        table = parse_table(run("txqueue_stats", "beta", "nothing-here", database="default"))
        assert list(table) == ["beta", "nothing-here"]
        assert set(numbers(table["nothing-here"]).values()) == {0.0}

    def test_json_is_the_stats_dicts(self, two_queues):
        stats = json.loads(run("txqueue_stats", "--json"))
        assert [s["queue"] for s in stats] == ["alpha", "beta"]
        alpha, beta = stats
        assert alpha.keys() == Queue("alpha").stats().keys()
        assert {k: alpha[k] for k in ("ready", "in_progress", "done", "failed", "stuck")} == {
            "ready": 2,
            "in_progress": 1,
            "done": 1,
            "failed": 1,
            "stuck": 1,
        }
        assert 3590 <= alpha["oldest_ready_age_s"] <= 3700
        assert beta == Queue("beta").stats()

    def test_empty_database(self, db):
        assert run("txqueue_stats").strip() == "No queue items."
        assert json.loads(run("txqueue_stats", "--json")) == []

    def test_unknown_database_alias(self, db):
        with pytest.raises(CommandError, match="Unknown database alias 'nope'"):
            run("txqueue_stats", "--database", "nope")

    def test_invalid_queue_name(self, db):
        with pytest.raises(CommandError, match="queue name must be 1 to 100 characters"):
            run("txqueue_stats", "x" * 101)


class TestRequeueStuck:
    def test_rescues_expired_leases_in_every_queue(self, db):
        alpha, beta = Queue("alpha"), Queue("beta")
        alpha.enqueue_many([{"n": n} for n in range(3)])
        hung, alive, _ = alpha.claim(3)
        beta.enqueue({"n": 3}, max_attempts=1)
        (spent,) = beta.claim(1)
        expire([hung, spent])

        out = run("txqueue_requeue_stuck")

        assert re.search(r"\bRescued 2 stuck item", out)
        assert QueueItem.objects.get(pk=hung.pk).status == Status.READY
        assert QueueItem.objects.get(pk=alive.pk).status == Status.IN_PROGRESS
        # Its only attempt was spent: FAILED, not READY.
        rescued = QueueItem.objects.get(pk=spent.pk)
        assert rescued.status == Status.FAILED and rescued.finished_at is not None
        assert rescued.last_error.startswith("stuck")
        assert alpha.claim(5) == [hung]
        assert re.search(r"\bRescued 0 stuck item", run("txqueue_requeue_stuck"))

    def test_every_queue_honours_its_rescue_setting(self, db, settings):
        settings.TXQUEUE = {"QUEUES": {"once": {"RESCUE": "fail"}}}
        once, again = Queue("once"), Queue("again")
        once.enqueue({"n": 1})
        again.enqueue({"n": 2})
        expire(once.claim(1) + again.claim(1))

        assert re.search(r"\bRescued 2 stuck item", run("txqueue_requeue_stuck"))

        assert once.items.get().status == Status.FAILED
        assert again.items.get().status == Status.READY

    def test_named_queues_only(self, db):
        alpha, beta = Queue("alpha"), Queue("beta")
        alpha.enqueue({"n": 1})
        beta.enqueue({"n": 2})
        expire(alpha.claim(1) + beta.claim(1))

        out = run("txqueue_requeue_stuck", "beta", "--database", "default")

        assert re.search(r"\bRescued 1 stuck item", out)
        assert alpha.items.stuck().count() == 1
        assert beta.items.get().status == Status.READY

    def test_unknown_database_alias(self, db):
        with pytest.raises(CommandError, match="Unknown database alias"):
            run("txqueue_requeue_stuck", database="nope")


class TestPurge:
    @pytest.fixture
    def finished(self, db):
        """alpha: DONE and FAILED items 10 days old and 1 day old, one DONE just now, one
        IN_PROGRESS and one READY (both with an old finished_at, which must not matter).
        beta: one DONE 10 days old."""
        alpha, beta = Queue("alpha"), Queue("beta")
        alpha.enqueue_many([{"n": n} for n in range(6)])
        old_done, old_failed, day_done, day_failed, fresh, running = alpha.claim(6)
        for item in (old_done, day_done, fresh):
            assert item.ack()
        for item in (old_failed, day_failed):
            assert item.fail("boom")
        alpha.enqueue({"n": 6})
        finished_ago([old_done, old_failed, running], days=10)
        alpha.items.filter(status=Status.READY).update(
            finished_at=timezone.now() - dt.timedelta(days=10)
        )
        finished_ago([day_done, day_failed], days=1)
        beta.enqueue({"n": 7})
        (beta_done,) = beta.claim(1)
        assert beta_done.ack()
        finished_ago([beta_done], days=10)
        return {
            "old": {old_done.pk, old_failed.pk},
            "day": {day_done.pk, day_failed.pk},
            "fresh": fresh.pk,
            "running": running.pk,
        }

    def remaining(self, queue):
        return set(Queue(queue).items.values_list("pk", flat=True))

    def test_only_old_finished_items_of_the_named_queue(self, finished):
        alpha_before = self.remaining("alpha")

        out = run("txqueue_purge", "alpha", "--older-than", "7")

        assert re.search(r"\bDeleted 2 finished item", out)
        assert self.remaining("alpha") == alpha_before - finished["old"]
        assert Queue("beta").count(status=None) == 1
        assert QueueItem.objects.get(pk=finished["running"]).status == Status.IN_PROGRESS
        assert Queue("alpha").count(Status.READY) == 1

    def test_every_queue_and_fractional_days(self, finished):
        alpha_before = self.remaining("alpha")

        assert re.search(r"\bDeleted 3 finished item", run("txqueue_purge", older_than=7))
        assert Queue("beta").count(status=None) == 0

        out = run("txqueue_purge", "--older-than", "0.5", "--database", "default")
        assert re.search(r"\bDeleted 2 finished item", out)
        assert self.remaining("alpha") == alpha_before - finished["old"] - finished["day"]
        assert Queue("alpha").count(Status.DONE) == 1  # finished just now
        assert Queue("alpha").count(Status.READY) == 1
        assert Queue("alpha").count(Status.IN_PROGRESS) == 1

    def test_nothing_to_purge(self, db):
        assert re.search(r"\bDeleted 0 finished item", run("txqueue_purge", older_than=0))

    def test_a_purge_of_every_queue_deletes_old_once_records(self, db):
        with once("old"), once("new"):
            pass
        Effect.objects.filter(key="old").update(recorded_at=timezone.now() - dt.timedelta(days=8))
        assert "once() record" not in run("txqueue_purge", "alpha", older_than=7)
        assert Effect.objects.count() == 2  # not per queue: a named purge keeps them
        assert re.search(r"\bDeleted 1 once\(\) record", run("txqueue_purge", older_than=7))
        assert list(Effect.objects.values_list("key", flat=True)) == ["new"]

    @pytest.mark.parametrize("days", ["-1", "-0.5", "nan", "inf", "36501", "1e12"])
    def test_bad_days(self, finished, days):
        before = QueueItem.objects.count()
        with pytest.raises(CommandError, match="--older-than"):
            run("txqueue_purge", f"--older-than={days}")
        assert QueueItem.objects.count() == before

    def test_older_than_is_required(self, db):
        with pytest.raises(CommandError, match="--older-than"):
            run("txqueue_purge", "alpha")

    def test_unknown_database_alias(self, db):
        with pytest.raises(CommandError, match="Unknown database alias 'nope'"):
            run("txqueue_purge", older_than=1, database="nope")


class TestRunQueueConsumer:
    """Argument handling of ``run_queue_consumer``; the loop itself is in test_worker.py."""

    def test_unknown_queue_is_an_error_listing_the_known_ones(self, db, run_consumer):
        with pytest.raises(CommandError) as raised:
            run_consumer("echo", "nope", "--burst")
        message = str(raised.value)
        assert message.startswith("No handler for queue 'nope'.")
        known = message.split("Known queues: ", 1)[1].rstrip(".").split(", ")
        assert known == sorted(known)
        assert {"boom", "echo", "slow", "default", "tasks-other"} <= set(known)
        assert "'echo'" not in message.split("Known queues")[0]
        assert not Consumer.objects.exists()  # nothing started

    def test_no_queues_at_all_is_an_error(self, db, run_consumer, settings, monkeypatch):
        monkeypatch.setattr(registry, "handlers", dict)
        del settings.TASKS
        with pytest.raises(CommandError, match="No queues to consume.*Known queues: none"):
            run_consumer("--burst")

    def test_unknown_database_alias(self, db, run_consumer):
        with pytest.raises(CommandError, match="Unknown database alias 'nope'; DATABASES has: "):
            run_consumer("--burst", "--database", "nope")
        with pytest.raises(CommandError, match="Unknown database alias 'nope'"):
            run_consumer("echo", "--burst", database="nope")
        assert not Consumer.objects.exists()

    @pytest.mark.slow
    def test_a_database_not_migrated_is_named_not_retried(self, db, tmp_path):
        """A missing table is no outage: the consumer says to migrate and exits 1."""
        with empty_database(tmp_path) as name:
            env = {**child_env(), "TXQUEUE_TEST_NAME": name}
            command = [sys.executable, "-m", "django", "run_queue_consumer", "echo", "--burst"]
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 1
        assert "Database 'default' has no django_txqueue_" in done.stderr
        assert "django_txqueue_consumer" in done.stderr
        assert "django_txqueue_queueitem" in done.stderr
        assert "tables: run" in done.stderr  # every table of the app is missing
        assert "run `python manage.py migrate`" in done.stderr
        assert "retrying" not in done.stderr

    # Django's model checks ask every database's features (SQLite's JSON support: a query).
    @pytest.mark.django_db(databases=["default", "other"])
    def test_a_consumer_stopped_by_its_checks_leaves_nothing_open(self, settings):
        """The wake-up socket and pipe a consumer opens when it is made are closed when
        the system checks stop it before it runs."""
        settings.TXQUEUE = {**settings.TXQUEUE, "NO_SUCH_KEY": 1}
        opened = len(os.listdir("/proc/self/fd"))
        with pytest.raises(SystemCheckError, match="txqueue.E002"):
            call_command("run_queue_consumer", "echo", "--burst", skip_checks=False)
        assert len(os.listdir("/proc/self/fd")) == opened

    @pytest.mark.parametrize(
        "option", ["--concurrency=0", "--batch=-1", "--processes=0", "--strategy=fastest"]
    )
    def test_bad_options(self, db, run_consumer, option):
        with pytest.raises(CommandError, match=option.split("=")[0]):
            run_consumer("echo", "--burst", option)

    @pytest.mark.django_db(transaction=True)
    def test_burst_without_names_serves_handler_and_tasks_queues(self, run_consumer):
        echo = Queue("echo").enqueue_many([{"n": n} for n in range(3)])
        noop = enqueue("noop", {})
        task_items: list[Any] = []
        if TASKS_FRAMEWORK is not None:
            from tests.testapp import tasks

            task_items = [tasks.add.enqueue(1, 2), tasks.shout.enqueue("hi")]

        run_consumer("--burst", "--batch", "2")

        assert Queue("echo").count(status=Status.DONE) == len(echo) == 3
        assert QueueItem.objects.get(pk=noop.pk).status == Status.DONE
        results = [QueueItem.objects.get(pk=int(r.id)).result for r in task_items]
        assert results == ([3, "HI"] if task_items else [])
        consumer = Consumer.objects.get()
        assert consumer.queues == [*sorted(registry.handlers()), "django_txqueue.on_commit"]
        assert {"echo", "noop", "default", "tasks-other"} <= set(consumer.queues)
        assert consumer.stopped_at is not None and consumer.processed == 4 + len(task_items)

    @pytest.mark.django_db(transaction=True)
    def test_burst_with_names_serves_only_those(self, run_consumer):
        Queue("echo").enqueue({})
        boom = Queue("boom").enqueue({})
        run_consumer("echo", "--burst")
        assert Queue("echo").count(status=Status.DONE) == 1
        assert QueueItem.objects.get(pk=boom.pk).status == Status.READY
        assert Consumer.objects.get().queues == ["echo", "django_txqueue.on_commit"]


@pytest.mark.django_db(transaction=True)
class TestCommand:
    def test_unknown_queue_is_a_command_error_listing_known_ones(self):
        with pytest.raises(CommandError, match=r"'nope'.*Known queues: .*boom.*echo"):
            call_command("run_queue_consumer", "nope", "--burst")

    def test_burst_command_processes_the_named_queue(self):
        Queue("echo").enqueue_many([{}] * 5)
        call_command("run_queue_consumer", "echo", "--burst", "--batch", "2", verbosity=0)
        assert Queue("echo").count(status=Status.DONE) == 5
