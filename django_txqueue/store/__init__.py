"""Every change of queue rows, one function per intent, by the rows it changes.

Nothing else in the package writes queue rows (``tests/test_architecture.py`` checks it).
Each change after a claim is fenced: it names the claim token it expects and only touches a
row still IN_PROGRESS under it, so a consumer whose claim was taken over changes nothing and
learns so from the return value. Functions take the items, querysets or models to act on,
so the store works for any ``QueueModel`` and imports no models itself.

- ``items``: new items (enqueue, dedup, bounds), ``once()`` records, the schedule's ticks;
- ``claims``: claims, and the claim that carries the last batch's acknowledgement;
- ``acks``: settling a claim: acknowledge, retry, fail, release;
- ``upkeep``: leases, rescues, requeues, purges;
- ``control``: cancelling items, pausing and resuming queues;
- ``progress``: running items' progress reports;
- ``consumers``: the consumers' identities and their ``Consumer`` rows;
- ``conflicts``: a transaction refused by a conflict, run again;
- ``backoff`` and ``fairness``: retry delays, and fair and ordered queues' rounds and filters.

Callers use the names re-exported here (``store.ack``, ``store.claim``...), and
``store.Ack``, what a settled batch must acknowledge (``db.acks``).
"""

from ..db.acks import Ack, claimed_dependents
from .acks import (
    ack,
    ack_many,
    fail,
    mark_done,
    now_plus,
    release,
    retry,
    snooze,
)
from .claims import (
    Limits,
    ack_and_claim,
    claim,
    claim_limited,
    claim_values,
    lease_of,
    queues_with_due_items,
    rides_with_claims,
)
from .conflicts import TRANSIENT_RETRIES, retrying_conflicts
from .consumers import (
    ConsumerIdentity,
    beat,
    consumer_identity,
    delete_consumers,
    new_identity,
    register,
    stop,
)
from .control import cancel, cancel_item, pause, resume
from .items import (
    enqueue,
    enqueue_flow,
    enqueue_tick,
    insert,
    record_effect,
    trim_ticks,
)
from .progress import forget_reports, read_progress, report_progress, running_reports
from .rates import Allowance, KeyGrants
from .upkeep import (
    PURGE_LOCK,
    delete_all,
    delete_finished,
    fail_many,
    purge,
    purge_consumers,
    purge_effects,
    release_lost,
    renew_leases,
    requeue,
    rescue,
    try_lock,
)

__all__ = [
    "TRANSIENT_RETRIES",
    "retrying_conflicts",
    "new_identity",
    "ConsumerIdentity",
    "consumer_identity",
    "register",
    "beat",
    "stop",
    "delete_consumers",
    "enqueue",
    "insert",
    "record_effect",
    "enqueue_flow",
    "enqueue_tick",
    "trim_ticks",
    "claim",
    "claim_values",
    "lease_of",
    "ack_and_claim",
    "Limits",
    "claim_limited",
    "Allowance",
    "KeyGrants",
    "queues_with_due_items",
    "rides_with_claims",
    "ack",
    "mark_done",
    "ack_many",
    "Ack",
    "claimed_dependents",
    "retry",
    "fail",
    "release",
    "snooze",
    "now_plus",
    "PURGE_LOCK",
    "renew_leases",
    "rescue",
    "requeue",
    "fail_many",
    "delete_finished",
    "delete_all",
    "release_lost",
    "purge",
    "purge_consumers",
    "purge_effects",
    "try_lock",
    "cancel",
    "cancel_item",
    "pause",
    "resume",
    "report_progress",
    "read_progress",
    "running_reports",
    "forget_reports",
]
