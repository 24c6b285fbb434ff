"""A consumer's memory over a long drain: RSS of one ``run_queue_consumer`` process.

    PYTHONPATH=. DJANGO_SETTINGS_MODULE=tests.settings TXQUEUE_TEST_DB=postgresql \\
        python -m benchmarks.rss [ITEMS]

Fills ITEMS (default 100,000) items on the ``noop`` queue, drains them with one consumer
process (one handler thread, batch 10, ``--burst``) and samples its VmRSS (Linux /proc)
every half second: after the first tenth of the items, the maximum and the last sample.
Flat from the first tenth on means nothing accumulates per item. Uses its own database
(``txqueue_bench_rss``) or, on SQLite, a temp file.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from .database import prepare_database

VENDOR = os.environ.get("TXQUEUE_TEST_DB", "sqlite")


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS"):
                    return int(line.split()[1]) / 1024
    except FileNotFoundError:
        pass
    return None


def main() -> None:
    items = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    prepare_database(VENDOR, "txqueue_bench_rss")
    from django.conf import settings

    from django_txqueue import Queue, Status
    from django_txqueue.models import QueueItem

    QueueItem.objects.all().delete()
    for start in range(0, items, 10_000):
        Queue("noop").enqueue_many([{"n": n} for n in range(start, min(start + 10_000, items))])
    env = {**os.environ, "TXQUEUE_TEST_NAME": str(settings.DATABASES["default"]["NAME"])}
    command = [sys.executable, "-m", "django", "run_queue_consumer", "noop", "--burst"]
    child = subprocess.Popen([*command, "--batch", "10"], env=env, stdout=subprocess.DEVNULL)
    done = QueueItem.objects.filter(status=Status.DONE)
    after_a_tenth = None
    samples = []
    while child.poll() is None:
        if (mb := rss_mb(child.pid)) is not None:
            samples.append(mb)
        if after_a_tenth is None and done.count() >= items // 10:
            after_a_tenth = samples[-1] if samples else None
        time.sleep(0.5)
    print(
        f"{VENDOR}: {done.count():,} of {items:,} items drained; consumer RSS after a tenth"
        f" {after_a_tenth or 0:.1f} MB, max {max(samples, default=0):.1f} MB,"
        f" last {samples[-1] if samples else 0:.1f} MB"
    )


if __name__ == "__main__":
    main()
