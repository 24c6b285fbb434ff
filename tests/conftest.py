import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.db import connection

from django_txqueue import Queue

ROOT = Path(__file__).resolve().parent.parent
_names = itertools.count()


def strategies():
    """Every claim strategy the connected database supports."""
    found = ["update_limit"]
    if connection.features.has_select_for_update_skip_locked:
        found.append("skip_locked")
    return found


@pytest.fixture(params=["update_limit", "skip_locked"])
def strategy(request):
    if request.param not in strategies():
        pytest.skip(f"{connection.display_name} has no {request.param}")
    return request.param


@pytest.fixture
def queue(db):
    return Queue(f"q{next(_names)}")


def child_env():
    """Environment for a child process that must open this test database."""
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "TXQUEUE_TEST_NAME": str(connection.settings_dict["NAME"]),
        "PYTHONPATH": str(ROOT),
    }


@pytest.fixture
def db_child_env():
    """child_env() for a child started from the test itself."""
    return child_env()


@pytest.fixture
def spawn_claimers():
    """Start N real OS processes that claim from one queue until it is empty.

    Each returns the ids it claimed (and acknowledged). They start together at a
    wall-clock instant so that their claims overlap.
    """

    def spawn(queue_name, processes, *, strategy, batch):
        start_at = time.time() + 1.5
        children = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.concurrency.claimer",
                    queue_name,
                    strategy,
                    str(batch),
                    str(start_at),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=child_env(),
                cwd=ROOT,
            )
            for _ in range(processes)
        ]
        results = []
        for child in children:
            out, err = child.communicate(timeout=120)
            assert child.returncode == 0, err.decode()
            results.append(json.loads(out))
        return results

    return spawn
