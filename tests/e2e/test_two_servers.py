"""Queues on two database servers, one consumer process serving both.

The default database is this run's test database on the shared server; queue
"elsewhere" lives on a throwaway server of the same vendor (``server``, from
conftest.py), as a queue moved to a server of its own would. Runs in the suite run of
that vendor; under ``CI=true`` missing server binaries fail it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from django_txqueue import Status, enqueue_many
from django_txqueue.models import Consumer, QueueItem
from tests.helpers import child_env as shared_child_env

from .servers import DBNAME, DONE, FAST, ROOT, counts, enqueue, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

ITEMS = 200
ELSEWHERE = {"QUEUES": {"elsewhere": {"DATABASE": "other"}}}


def consumer_of_both(server, tmp_path) -> subprocess.Popen[bytes]:
    """``run_queue_consumer echo elsewhere``: "echo" on the shared server's test
    database, "elsewhere" on ``server``'s. Its log goes to a file (``.log``): a pipe
    nobody reads while it runs could fill and stop it."""
    env = {
        **shared_child_env(),
        "TXQUEUE_TEST_OTHER_DB": server.vendor,
        "TXQUEUE_TEST_OTHER_NAME": DBNAME,
        "TXQUEUE_TEST_OTHER_PORT": str(server.port),
        "TXQUEUE_TEST_OTHER_USER": server.user,
        "TXQUEUE_TEST_SETTINGS": json.dumps({**FAST, **ELSEWHERE}),
    }
    log = tmp_path / "consumer.log"
    with log.open("wb") as err:
        consumer = subprocess.Popen(
            [sys.executable, "-m", "django", "run_queue_consumer", "echo", "elsewhere", "-v", "2"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    consumer.log = log
    return consumer


def drained(consumer, condition, what):
    try:
        wait_for(lambda: consumer.poll() is not None or condition(), timeout=60, what=what)
    except BaseException:
        print(consumer.log.read_text()[-5000:])  # shown with the failure
        raise
    assert consumer.poll() is None, f"the consumer died:\n{consumer.log.read_text()[-3000:]}"


def stopped(consumer) -> str:
    """Stop the consumer (SIGTERM) and return its log."""
    consumer.terminate()
    consumer.wait(timeout=30)
    return consumer.log.read_text()


def echo_done():
    return QueueItem.objects.filter(queue="echo", status=Status.DONE).count()


def test_one_consumer_drains_queues_on_two_servers(server, tmp_path):
    server.query(DBNAME, "DELETE FROM django_txqueue_queueitem")
    enqueue_many("echo", list(range(ITEMS)))
    enqueue(server, "elsewhere", f"list(range({ITEMS}))")  # its default there: our "other"
    consumer = consumer_of_both(server, tmp_path)
    try:
        drained(
            consumer,
            lambda: counts(server, "elsewhere") == {DONE: ITEMS} and echo_done() == ITEMS,
            "both queues drained",
        )
    finally:
        log = stopped(consumer)
    assert consumer.returncode == 0, log[-3000:]
    # One Consumer row on each server, for the same consumer, each counting its own.
    here = Consumer.objects.get()
    there = server.query(DBNAME, "SELECT identity, processed FROM django_txqueue_consumer")
    assert [(here.identity, here.processed)] == [(there[0][0], ITEMS)] and len(there) == 1
    assert here.processed == ITEMS


def test_a_server_that_goes_down_does_not_stop_the_other(server, tmp_path):
    """The consumer pauses the database it lost and goes on with the other; when the
    server is back it serves that one again, without a restart."""
    server.query(DBNAME, "DELETE FROM django_txqueue_queueitem")
    server.query(DBNAME, "DELETE FROM django_txqueue_consumer")
    consumer = consumer_of_both(server, tmp_path)
    try:
        enqueue(server, "elsewhere", "list(range(20))")
        drained(consumer, lambda: counts(server, "elsewhere") == {DONE: 20}, "the first 20")
        server.stop()
        enqueue_many("echo", list(range(ITEMS)))
        drained(consumer, lambda: echo_done() == ITEMS, "the other server's queue, meanwhile")
        server.start()
        enqueue(server, "elsewhere", "list(range(20))")
        drained(consumer, lambda: counts(server, "elsewhere") == {DONE: 40}, "20 more, once back")
    finally:
        log = stopped(consumer)
    assert consumer.returncode == 0, log[-3000:]
    assert "(database 'other')" in log  # the pause named the database it was for
