"""The rescue job: stuck items of a consumer's queues back to READY (or FAILED, or
CANCELLED when asked to stop), and its own claims whose answer never reached it released.

It runs every ``RESCUE_INTERVAL`` from start-up: an item whose consumer died is READY again
within its lease plus ``RESCUE_INTERVAL`` of the death, while any consumer of its queue runs.
``Queue.requeue_stuck()`` and ``txqueue_requeue_stuck`` do the same on demand.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import timedelta

from .. import store
from ..api import Queue
from ..models import QueueItem
from ..observe import metrics
from ..observe.logs import counted

logger = logging.getLogger(__name__)

# A claim of ours older than this that we do not hold lost its answer on the way back.
LOST_CLAIM_AGE = timedelta(seconds=10)


def rescue_stuck(alias: str, queues: Iterable[Queue]) -> int:
    """Rescue the stuck items of ``queues``: one look at which of them have any
    (IN_PROGRESS rows are few), then an UPDATE for each of those, with its ``RESCUE``
    setting; not one per queue served. How many were rescued."""
    by_name = {queue.name: queue for queue in queues}
    stuck = QueueItem.objects.using(alias).filter(queue__in=list(by_name)).stuck()
    names = stuck.order_by().values_list("queue", flat=True).distinct()
    by_queue = {name: by_name[name].requeue_stuck() for name in set(names)}
    rescued = sum(by_queue.values())
    if rescued and metrics.recorder is not None:
        for name, count in by_queue.items():
            metrics.recorder.rescued_items(name, count)
    if rescued:
        logger.warning("rescued %s", counted(rescued, "stuck item"))
    return rescued


def release_lost_claims(alias: str, identity: str, held: Iterable[object]) -> int:
    """Put back READY the items this consumer claimed and does not hold (pks ``held``):
    claims whose answer was lost when the connection broke after the server committed."""
    lost = store.release_lost(QueueItem, alias, identity, held, LOST_CLAIM_AGE)
    if lost:
        logger.warning(
            "released %s claimed by a claim whose answer was lost", counted(lost, "item")
        )
    return lost
