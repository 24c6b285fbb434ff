"""Queues on two database servers, one consumer process serving both (issue 25).

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


def test_one_consumer_drains_queues_on_two_servers(server):
    env = {
        **shared_child_env(),
        "TXQUEUE_TEST_OTHER_DB": server.vendor,
        "TXQUEUE_TEST_OTHER_NAME": DBNAME,
        "TXQUEUE_TEST_OTHER_PORT": str(server.port),
        "TXQUEUE_TEST_OTHER_USER": server.user,
        "TXQUEUE_TEST_SETTINGS": json.dumps({**FAST, **ELSEWHERE}),
    }
    server.query(DBNAME, "DELETE FROM django_txqueue_queueitem")
    enqueue_many("echo", list(range(ITEMS)))
    enqueue(server, "elsewhere", f"list(range({ITEMS}))")  # its default there: our "other"
    consumer = subprocess.Popen(
        [sys.executable, "-m", "django", "run_queue_consumer", "echo", "elsewhere"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        wait_for(
            lambda: (
                consumer.poll() is not None
                or counts(server, "elsewhere") == {DONE: ITEMS}
                and QueueItem.objects.filter(queue="echo", status=Status.DONE).count() == ITEMS
            ),
            timeout=60,
            what="both queues drained",
        )
        assert consumer.poll() is None, "the consumer died"
    finally:
        consumer.terminate()
        _, err = consumer.communicate(timeout=30)
    assert consumer.returncode == 0, err.decode()[-3000:]
    # One Consumer row on each server, for the same consumer, each counting its own.
    here = Consumer.objects.get()
    there = server.query(DBNAME, "SELECT identity, processed FROM django_txqueue_consumer")
    assert [(here.identity, here.processed)] == [(there[0][0], ITEMS)] and len(there) == 1
    assert here.processed == ITEMS
