"""txqueue_bench's scale part (django_txqueue.contrib.bench.scale) on a small table: the
claim rate and, beside it, the CPU time per item, each against the first backlog's."""

import pytest

from django_txqueue.contrib.bench import scale
from django_txqueue.contrib.progress import Progress
from django_txqueue.contrib.target import Target
from django_txqueue.models import QueueItem


@pytest.mark.django_db(transaction=True)
def test_each_backlog_has_its_cpu_time_per_item_beside_its_rate():
    rows = scale.run(
        Target(alias="default", queue="txqueue-bench"),
        scale_rows=2000,
        claims=50,
        progress=Progress(None),
    )
    assert [row["claimed"] for row in rows] == [50, 50, 50]
    assert all(row["rate"] > 0 and row["cpu_us"] > 0 for row in rows)
    assert rows[0]["percent"] == pytest.approx(100)
    assert rows[0]["cpu_percent"] == pytest.approx(100)
    # The rate by CPU time: the first's CPU time per item over this one's.
    for row in rows:
        assert row["cpu_percent"] == pytest.approx(100 * rows[0]["cpu_us"] / row["cpu_us"])
    assert not QueueItem.objects.filter(queue="txqueue-bench").exists()
