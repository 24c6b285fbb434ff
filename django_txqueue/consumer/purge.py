"""The purge job: the DONE, FAILED and CANCELLED items of a consumer's queues finished
over their ``RETENTION`` ago, the ``once()`` records older than the longest retention, and
the rows of consumers silent for over ``CONSUMERS_KEPT`` (each ``--burst`` run leaves one),
deleted in batches.

One consumer of a database purges at a time (a lock it only tries, so the others skip), for
at most a given time; what is left waits for the next run. On PostgreSQL the lock is its
transaction's, and the run is that one transaction, so that a transaction pool (PgBouncer)
cannot separate the lock from its release. ``Queue.purge()`` and ``txqueue_purge`` purge
on demand.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from datetime import timedelta

from .. import conf, store
from ..api import Queue
from ..models import Consumer, Effect, QueueItem, QueueProgress
from ..observe.logs import counted

logger = logging.getLogger(__name__)

# The row of a consumer stopped (or gone) this long is deleted: a day to look at what a
# run did, then no trail of rows from a cron job's --burst runs in the admin.
CONSUMERS_KEPT = timedelta(days=1)


def purge_finished(alias: str, queues: Iterable[Queue], until: float) -> bool:
    """Purge on ``alias`` until the monotonic instant ``until``, if no other consumer of the
    database is purging; False if cut short there. With nothing kept for a limited time,
    no lock is taken either."""
    # The queues kept alike are purged together: one statement per batch for them all,
    # not one per queue (a consumer serving 50 queues ran 50 at start-up).
    kept_alike: dict[timedelta, list[str]] = {}
    for queue in queues:
        if (retention := conf.retention(queue.name)) is not None:
            kept_alike.setdefault(retention, []).append(queue.name)
    kept_for = conf.effect_retention()
    if not kept_alike and kept_for is None:
        return True
    with store.try_lock(alias, store.PURGE_LOCK) as mine:
        if not mine:
            return True
        items = effects = rows = 0
        for retention, names in kept_alike.items():
            finished = QueueItem.objects.using(alias).filter(queue__in=names)
            items += store.purge(finished, retention, until=until)
            if time.monotonic() >= until:
                break  # the others next time (each purge does a batch at least)
        if kept_for is not None and time.monotonic() < until:
            effects = store.purge_effects(Effect.objects.using(alias), kept_for, until=until)
        if time.monotonic() < until:
            consumers = Consumer.objects.using(alias)
            rows = store.purge_consumers(
                consumers, QueueItem.objects.using(alias), CONSUMERS_KEPT, until=until
            )
    if items:
        store.forget_reports(QueueItem, QueueProgress, alias)
    if items or effects or rows:
        logger.info(
            "purged %s, %s and %s",
            counted(items, "finished item"),
            counted(effects, "once() record"),
            counted(rows, "stopped consumer's row", "stopped consumers' rows"),
        )
    return time.monotonic() < until
