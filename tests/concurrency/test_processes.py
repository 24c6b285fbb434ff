"""Several real OS processes claim from one database at once: nothing twice, nothing lost."""

import collections

import pytest

from django_txqueue import Queue, Status
from django_txqueue.models import QueueItem

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.mark.parametrize("batch", [1, 10])
def test_four_processes_claim_every_item_exactly_once(spawn_claimers, strategy, batch):
    queue = Queue(f"race-{strategy}-{batch}")
    enqueued = {item.pk for item in queue.enqueue_many([{"n": n} for n in range(2000)])}
    if not all(enqueued):
        enqueued = set(queue.items.values_list("pk", flat=True))

    results = spawn_claimers(queue.name, 4, strategy=strategy, batch=batch)

    claimed = collections.Counter(pk for ids in results for pk in ids)
    assert set(claimed) == enqueued, "an item was lost"
    assert max(claimed.values()) == 1, "an item was claimed twice"
    assert sum(1 for ids in results if ids) >= 2, "the processes did not overlap"
    rows = QueueItem.objects.filter(queue=queue.name)
    assert rows.filter(status=Status.DONE, attempts=1).count() == 2000


RESCUER = """
import json, sys, time
import django
django.setup()
from django_txqueue import Queue
time.sleep(max(0.0, float(sys.argv[2]) - time.time()))
print(json.dumps(Queue(sys.argv[1]).requeue_stuck()))
"""


def test_concurrent_rescuers_rescue_each_stuck_item_exactly_once(db_child_env):
    """Four processes rescue at the same instant: their counts add up to the stuck items."""
    import datetime as dt
    import json
    import subprocess
    import sys
    import time

    from django.utils import timezone

    queue = Queue("rescue-race")
    queue.enqueue_many([{"n": n} for n in range(600)])
    queue.claim(600, pid="crashed")
    QueueItem.objects.filter(queue=queue.name).update(
        lease_expires_at=timezone.now() - dt.timedelta(seconds=1)
    )
    start_at = str(time.time() + 1.5)
    children = [
        subprocess.Popen(
            [sys.executable, "-c", RESCUER, queue.name, start_at],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=db_child_env,
        )
        for _ in range(4)
    ]
    counts = []
    for child in children:
        out, err = child.communicate(timeout=60)
        assert child.returncode == 0, err.decode()
        counts.append(json.loads(out))
    assert sum(counts) == 600
    assert queue.count() == 600 and not queue.items.stuck().exists()
