"""RETENTION: the settings, the purge lock, and what a consumer's liveness thread purges.

Real consumer processes purging are in tests/e2e/test_consumer_processes.py.
"""

import datetime as dt
import os
import subprocess
import sys
import threading
import time

import pytest
from django.db import DatabaseError, connections
from django.utils import timezone

from django_txqueue import Queue, Status, conf, store
from django_txqueue.liveness import Liveness
from django_txqueue.models import Consumer, Effect, QueueItem
from tests.helpers import ROOT, child_env, finished_items, wait_for

OLD = dt.timedelta(days=10)


class TestSettings:
    def test_seven_days_by_default(self, settings):
        settings.TXQUEUE = {}
        assert conf.retention() == dt.timedelta(days=7)
        assert conf.retention("sms") == dt.timedelta(days=7)
        assert conf.get("PURGE_INTERVAL") == 300

    def test_seconds_timedelta_none_and_per_queue(self, settings):
        settings.TXQUEUE = {
            "RETENTION": 3600,
            "QUEUES": {"keep": {"retention": None}, "short": {"RETENTION": dt.timedelta(hours=1)}},
        }
        assert conf.retention() == dt.timedelta(hours=1)
        assert conf.retention("other") == dt.timedelta(hours=1)
        assert conf.retention("keep") is None
        assert conf.retention("short") == dt.timedelta(hours=1)
        settings.TXQUEUE = {"RETENTION": None, "QUEUES": {"sms": {"RETENTION": 60}}}
        assert conf.retention() is None
        assert conf.retention("sms") == dt.timedelta(minutes=1)

    def test_once_records_are_kept_for_the_longest_retention(self, settings):
        settings.TXQUEUE = {"RETENTION": 60, "QUEUES": {"long": {"RETENTION": 7200}}}
        assert conf.effect_retention() == dt.timedelta(hours=2)
        settings.TXQUEUE = {"QUEUES": {"keep": {"RETENTION": None}}}
        assert conf.effect_retention() is None
        settings.TXQUEUE = {"RETENTION": None, "QUEUES": {"sms": {"RETENTION": 60}}}
        assert conf.effect_retention() is None


LOCK = "txqueue_test_lock"


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


def try_lock_now(alias="default"):
    with store.try_lock(alias, LOCK) as held:
        return held


class TestLock:
    def test_while_one_connection_holds_it_another_connection_fails_at_once(self, db):
        with store.try_lock("default", LOCK) as held:
            assert held
            started = time.monotonic()
            assert in_other_thread(try_lock_now) is False
            assert time.monotonic() - started < 5  # tried, did not wait
        assert in_other_thread(try_lock_now) is True  # released
        assert try_lock_now() is True

    def test_locks_of_other_names_are_independent(self, db):
        with store.try_lock("default", LOCK) as held:
            assert held
            with store.try_lock("default", LOCK + "_other") as other:
                assert other

    def test_across_processes(self, db):
        child = subprocess.Popen(  # noqa: S603 - our own command line
            [
                sys.executable,
                "-c",
                "import sys, django; django.setup()\n"
                "from django_txqueue import store\n"
                "with store.try_lock('default', sys.argv[1]) as held:\n"
                "    print(held, flush=True)\n"
                "    sys.stdin.readline()\n",
                LOCK,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**child_env(), "DJANGO_SETTINGS_MODULE": "tests.settings"},
            cwd=ROOT,
            text=True,
        )
        with child:
            try:
                assert child.stdout.readline().strip() == "True"
                assert try_lock_now() is False
                _, err = child.communicate("\n", timeout=30)
                assert child.returncode == 0, err
                assert try_lock_now() is True
            finally:
                if child.poll() is None:
                    child.kill()

    def test_a_dead_holders_lock_is_free(self, db):
        child = subprocess.run(  # noqa: S603 - our own command line
            [
                sys.executable,
                "-c",
                "import os, sys, django; django.setup()\n"
                "from django_txqueue import store\n"
                "lock = store.try_lock('default', sys.argv[1])\n"
                "assert lock.__enter__()\n"
                "os._exit(0)  # no release\n",
                LOCK,
            ],
            env={**child_env(), "DJANGO_SETTINGS_MODULE": "tests.settings"},
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert child.returncode == 0, child.stderr
        assert wait_for(try_lock_now, timeout=10)


def finished(queue, status=Status.DONE, ago=OLD, n=1):
    return finished_items(queue, n, ago=ago, failed=status == Status.FAILED)


def liveness(*queues, on_database_error=lambda: None):
    return Liveness(
        Consumer(identity=store.new_identity(), host="test", os_pid=os.getpid()),
        "default",
        queues=lambda: [Queue(name) for name in queues],
        held=lambda: [],
        lease=None,
        counters=lambda: (0, 0),
        stopping=threading.Event(),
        on_database_error=on_database_error,
    )


def remaining():
    return set(QueueItem.objects.values_list("pk", flat=True))


class TestPurge:
    @pytest.fixture
    def items(self, db, settings):
        settings.TXQUEUE = {"RETENTION": 86400, "QUEUES": {"keep": {"RETENTION": None}}}
        old = finished("a") | finished("a", Status.FAILED) | finished("b", n=3)
        kept = finished("a", ago=dt.timedelta(hours=1)) | finished("keep") | finished("other")
        Queue("a").enqueue_many([{}] * 2)
        running, ready = Queue("a").items.filter(status=Status.READY).order_by("pk")
        Queue("a").claim(1)  # running: IN_PROGRESS
        Queue("a").items.filter(pk__in=[running.pk, ready.pk]).update(
            finished_at=timezone.now() - OLD  # must not matter
        )
        return {"old": old, "kept": kept | {running.pk, ready.pk}}

    def test_old_finished_items_of_its_queues_each_with_its_retention(self, items):
        assert liveness("a", "b", "keep")._purge(until=time.monotonic() + 60) is True
        assert remaining() == items["kept"]
        assert Queue("a").count(status=Status.IN_PROGRESS) == 1
        assert Queue("a").count(status=Status.READY) == 1

    def test_in_batches(self, items, monkeypatch):
        monkeypatch.setattr(store, "PURGE_BATCH", 2)
        liveness("a", "b", "keep")._purge(until=time.monotonic() + 60)
        assert remaining() == items["kept"]

    def test_retention_none_purges_nothing(self, items, settings):
        settings.TXQUEUE = {"RETENTION": None}
        Effect.objects.create(key="old")
        Effect.objects.update(recorded_at=timezone.now() - OLD)
        liveness("a", "b", "keep")._purge(until=time.monotonic() + 60)
        assert remaining() == items["old"] | items["kept"]
        assert Effect.objects.count() == 1

    def test_not_while_another_connection_holds_the_lock(self, items):
        holding, release = threading.Event(), threading.Event()

        def hold():
            with store.try_lock("default", store.PURGE_LOCK) as held:
                holding.set()
                release.wait(30)
                return held

        thread = threading.Thread(target=in_other_thread, args=(hold,))
        thread.start()
        try:
            assert holding.wait(30)
            assert liveness("a", "b")._purge(until=time.monotonic() + 60) is True
            assert remaining() == items["old"] | items["kept"]
        finally:
            release.set()
            thread.join(30)
        liveness("a", "b")._purge(until=time.monotonic() + 60)
        assert remaining() == items["kept"]

    def test_cut_short_at_the_deadline_after_one_batch(self, items, monkeypatch):
        monkeypatch.setattr(store, "PURGE_BATCH", 1)
        assert liveness("a", "b")._purge(until=time.monotonic() - 1) is False
        left = remaining() - items["kept"]
        assert left < items["old"] and len(left) == len(items["old"]) - 1

    def test_once_records_older_than_the_longest_retention(self, db, settings):
        settings.TXQUEUE = {"RETENTION": 3600, "QUEUES": {"long": {"RETENTION": 86400}}}
        for key, ago in (("old", OLD), ("day", dt.timedelta(hours=12)), ("new", dt.timedelta(0))):
            Effect.objects.create(key=key)
            Effect.objects.filter(key=key).update(recorded_at=timezone.now() - ago)
        liveness("a")._purge(until=time.monotonic() + 60)
        assert set(Effect.objects.values_list("key", flat=True)) == {"day", "new"}

    def test_an_error_is_logged_and_reported(self, items, monkeypatch, caplog):
        def broken(*args, **kwargs):
            raise DatabaseError("disk full")

        monkeypatch.setattr(store, "purge", broken)
        errors = []
        assert liveness("a", on_database_error=lambda: errors.append(1))._purge_safely(
            until=time.monotonic() + 60
        )
        assert "purge failed" in caplog.text and "disk full" in caplog.text
        assert errors == [1]


@pytest.mark.django_db(transaction=True)
def test_a_purge_cut_short_goes_on_after_the_next_heartbeat(settings, monkeypatch):
    """One batch of one item per run (PURGE_RUN 0): the whole backlog goes, one run per
    heartbeat, long before the next PURGE_INTERVAL."""
    settings.TXQUEUE = {"HEARTBEAT_INTERVAL": 0.05, "PURGE_INTERVAL": 3600, "RETENTION": 60}
    monkeypatch.setattr(store, "PURGE_BATCH", 1)
    monkeypatch.setattr("django_txqueue.liveness.PURGE_RUN", 0)
    old = finished("a", n=5)
    kept = finished("a", ago=dt.timedelta(0))
    thread = liveness("a")
    thread.start()
    try:
        assert wait_for(lambda: remaining() == kept, timeout=20)
    finally:
        thread.stopping.set()
        thread.stop()
    assert not old & remaining()


@pytest.mark.django_db(transaction=True)
def test_the_liveness_thread_goes_on_heartbeating_after_a_purge_error(settings, monkeypatch):
    settings.TXQUEUE = {"HEARTBEAT_INTERVAL": 0.1, "PURGE_INTERVAL": 0.1}
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise ValueError("a bug")

    monkeypatch.setattr(store, "purge", broken)
    finished("a")
    thread = liveness("a")
    thread.start()
    try:
        first = Consumer.objects.get(pk=thread.consumer.pk).last_heartbeat_at
        assert wait_for(lambda: len(calls) >= 3, timeout=20)
        assert wait_for(
            lambda: Consumer.objects.get(pk=thread.consumer.pk).last_heartbeat_at > first,
            timeout=20,
        )
        assert thread.thread.is_alive()
    finally:
        thread.stopping.set()
        thread.stop()
