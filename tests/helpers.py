"""Helpers shared by the tests: import them from here (``from tests.helpers import ...``).

conftest.py holds the fixtures only, and imports what it needs from this module.
"""

import datetime as dt
import os
import time
from pathlib import Path

from django.db import connection
from django.utils import timezone

ROOT = Path(__file__).resolve().parent.parent


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
        "PYTHONPATH": str(ROOT),
    }


def expire(item):
    """Move an item's lease into the past (database clock), as if time had passed."""
    from django_txqueue.models import QueueItem

    QueueItem.objects.filter(pk=item.pk).update(
        lease_expires_at=timezone.now() - dt.timedelta(seconds=5)
    )


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
