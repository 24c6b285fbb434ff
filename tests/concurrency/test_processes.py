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
