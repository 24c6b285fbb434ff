"""The bench's no-op handler, for the ``run_queue_consumer`` processes that
``txqueue_bench`` starts (``--drain-mode process``).

Registered only in a process given the bench's queue name in ``TXQUEUE_BENCH_QUEUE``:
the bench sets it for its own consumer processes, so a project that installs the bench
app gets no handler in its own consumers (which, started without queue names, serve
every queue that has one), needs no setting for the bench's queue, and its consumers do
not even import the bench.
"""

from __future__ import annotations

import os

from .gate import QUEUE_VARIABLE

if name := os.environ.get(QUEUE_VARIABLE):
    from django_txqueue import handler

    from .drain import handle
    from .gate import at_first_call, from_environment

    handler(name)(at_first_call(from_environment(), handle))
