"""Fixtures only; shared helper functions live in tests/helpers.py."""

import itertools
import json
import signal
import subprocess
import sys
import time

import pytest
from django.core.management import call_command
from django.db import connection

from django_txqueue import Queue

from .helpers import FAST, FEATURES, ROOT, child_env, has, strategies

_names = itertools.count()
CONSUMER_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@pytest.fixture(autouse=True)
def _database_features(request):
    """Skip a test marked ``requires(*features)`` on a database without one of them, and
    one marked ``lacks(*features)`` on a database with one (names: helpers.FEATURES)."""
    wanted = [
        (name, marker.name == "requires")
        for marker in request.node.iter_markers()
        if marker.name in ("requires", "lacks")
        for name in marker.args
    ]
    if not wanted:
        return
    unknown = [name for name, _ in wanted if name not in FEATURES]
    assert not unknown, f"no such feature in tests/helpers.py FEATURES: {unknown}"
    request.getfixturevalue("django_db_setup")  # some facts ask the server (its version)
    with request.getfixturevalue("django_db_blocker").unblock():
        for name, needed in wanted:
            if has(name) != needed:
                verb = "has no" if needed else "has"
                pytest.skip(f"{connection.display_name} {verb} {FEATURES[name].says}")


@pytest.fixture(params=["update_limit", "skip_locked"])
def strategy(request):
    if request.param not in strategies():
        pytest.skip(f"{connection.display_name} has no {request.param}")
    return request.param


@pytest.fixture
def queue(db):
    return Queue(f"q{next(_names)}")


@pytest.fixture
def fast_consumers(settings):
    """Consumers in this process heartbeat, rescue and retry quickly (helpers.FAST)."""
    settings.TXQUEUE = {**settings.TXQUEUE, **FAST}


@pytest.fixture
def db_child_env():
    """child_env() for a child started from the test itself."""
    return child_env()


@pytest.fixture
def run_consumer():
    """Run ``run_queue_consumer ARGS`` in this thread as ``manage.py`` does (verbosity 0
    unless given); the signal handlers the command installs are put back afterwards."""
    saved = {signum: signal.getsignal(signum) for signum in CONSUMER_SIGNALS}

    def run(*args, **options):
        options.setdefault("verbosity", 0)
        call_command("run_queue_consumer", *args, **options)

    yield run
    for signum, handler in saved.items():
        signal.signal(signum, handler)


@pytest.fixture
def spawn_claimers():
    """Start N real OS processes that claim from one queue until it is empty (or each
    has claimed ``max_items``).

    Each returns the ids it claimed (and acknowledged). They start together at a
    wall-clock instant so that their claims overlap.
    """

    def spawn(queue_name, processes, *, strategy, batch, hold_ms=0, max_items=0):
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
                    str(hold_ms),
                    str(max_items),
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
