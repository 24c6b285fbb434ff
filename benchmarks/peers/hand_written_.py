"""The hand-written loop (``txqueue_bench``'s ceiling, ``contrib/bench/raw.py``) on the
same table, batch and workers as django-txqueue's row: raw psycopg, one claim and one
acknowledging statement per batch, no Django in the loop. It has no wake-up to measure.

It bounds what any row here can reach with a claim and an acknowledgement per batch, and
so shows whether a target ratio to a peer is within reach on this machine at all."""

from __future__ import annotations

from . import txqueue_
from .common import Drained

NAME = "hand-written loop"
BATCH = txqueue_.BATCH


def prepare() -> None:
    """It writes django-txqueue's table, which the Django migrations made."""


def drain(items: int, processes: int) -> Drained:
    return txqueue_.drain_forked("by hand", items, processes)
