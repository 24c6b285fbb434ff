"""The hand-written loop (``txqueue_bench``'s ceiling, ``contrib/bench/raw.py``) on the
same table, batch and workers as django-txqueue's row: raw psycopg, one claim and one
acknowledging statement per batch, no Django in the loop. It has no wake-up to measure.

It bounds what any row here can reach with a claim and an acknowledgement per batch, and
so shows whether a target ratio to a peer is within reach on this machine at all. Its
enqueue is the one issue 28 measures against: a single-row INSERT into a minimal table
(``id``, ``payload``), what a project's own outbox table would cost."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psycopg

from django_txqueue.contrib.bench.raw import MINIMAL_COLUMNS, MINIMAL_TABLE

from . import txqueue_
from .common import Drained, conninfo, execute

NAME = "hand-written loop"
BATCH = txqueue_.BATCH
MINIMAL = MINIMAL_TABLE  # txqueue_bench's own baseline table, in the peers' database


def prepare() -> None:
    """It writes django-txqueue's table, which the Django migrations made, and its
    enqueue a minimal table of its own."""
    execute(f"CREATE TABLE IF NOT EXISTS {MINIMAL} ({MINIMAL_COLUMNS['postgresql']})")


def drain(items: int, processes: int) -> Drained:
    return txqueue_.drain_forked("by hand", items, processes)


@contextmanager
def enqueuer() -> Iterator[Callable[[int], float]]:
    """A single-row INSERT into the minimal table, in autocommit, with psycopg's own
    settings (as the peers' producers); the table emptied before and after."""
    execute(f"TRUNCATE {MINIMAL}")
    with psycopg.connect(conninfo(), autocommit=True) as connection:
        cursor = connection.cursor()
        insert = f"INSERT INTO {MINIMAL} (payload) VALUES (%s::jsonb) RETURNING id"

        def enqueue_one(n: int) -> float:
            cursor.execute(insert, [json.dumps({"n": n})])
            cursor.fetchone()
            return time.time()

        yield enqueue_one
    execute(f"TRUNCATE {MINIMAL}")
