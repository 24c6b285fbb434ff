"""Wake-up: how soon an idle consumer with default settings starts an item after the
producer's commit, and the same in the first second after a consumer starts (cold).

The consumer is a forked process running ``Worker`` on the bench queue; its handler
returns ``time.time()``, kept as the item's result. Latency runs from the producer's
commit (its first on_commit callback, registered before the enqueue, so the enqueue's
own after-commit wake-up counts as latency) to that handler start.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path
from typing import Any

from django.db import connections, transaction

from django_txqueue import Consumer, Queue, QueueItem, Status
from django_txqueue.consumer import wakeup as local_wakeup

from ..progress import Progress
from ..target import Target
from .raw import claim_statements, wakeup_baseline_label, wakeup_round_trips
from .report import latency, percent

GAP = 0.020  # seconds between items, and between baseline rounds
WARM_UP = 5  # uncounted items or rounds before each measurement
IDLE_SETTLE = 3.0  # seconds for the idle wait to grow to POLL_INTERVAL


class BenchError(Exception):
    """The measurement could not be made (a consumer that did not start, items not done)."""


def started_at(item: QueueItem) -> float:
    """The wake-up handler: when it started, stored as the item's result."""
    return time.time()


def consume(target: Target) -> None:
    """The forked consumer: runs until SIGTERM."""
    from django_txqueue.consumer.worker import Worker

    worker = Worker(handlers={target.queue: started_at}, using=target.alias)
    signal.signal(signal.SIGTERM, lambda signum, frame: worker.stop())
    try:
        worker.run()
    finally:
        connections.close_all()


class IdleConsumer:
    """A consumer process of the bench queue, started and stopped by the bench."""

    def __init__(self, target: Target) -> None:
        self.target = target
        connections.close_all()  # the child opens its own
        self.process = multiprocessing.get_context("fork").Process(target=consume, args=(target,))
        self.process.start()
        self.identity = self._wait_until_registered()

    def _wait_until_registered(self) -> str:
        live = Consumer.objects.using(self.target.alias).filter(
            os_pid=self.process.pid or 0, stopped_at__isnull=True
        )
        deadline = time.monotonic() + 30
        while not (identity := live.values_list("identity", flat=True).first()):
            if not self.process.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise BenchError("the wake-up consumer did not start")
            time.sleep(0.005)
        return str(identity)

    def cpu_seconds(self) -> float | None:
        """utime + stime of all its threads so far (Linux), else None."""
        stat = Path(f"/proc/{self.process.pid}/stat")
        if not stat.exists():
            return None
        fields = stat.read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.terminate()  # SIGTERM: a graceful stop
            self.process.join(timeout=30)
            if self.process.is_alive():
                self.process.kill()
        self.process.join()
        if getattr(self, "identity", None):
            self.target.forget_consumers([self.identity])


def latencies(target: Target, count: int, gap: float = GAP) -> list[float]:
    """Enqueue ``count`` items ``gap`` apart, each in its own transaction; return
    handler start - commit for each."""
    queue = Queue(target.queue, using=target.alias)
    committed: dict[int, float] = {}
    commit_time: list[float] = []
    start = time.monotonic()
    for n in range(count):
        time.sleep(max(0.0, start + n * gap - time.monotonic()))
        with transaction.atomic(using=target.alias):
            transaction.on_commit(lambda: commit_time.append(time.time()), using=target.alias)
            item = queue.enqueue({"n": n})
        committed[item.pk] = commit_time.pop()
    items = QueueItem.objects.using(target.alias).filter(pk__in=committed)
    deadline = time.monotonic() + 30
    while (done := items.filter(status=Status.DONE).count()) < count:
        if time.monotonic() > deadline:
            raise BenchError(f"only {done} of {count} wake-up items were done in 30 s")
        time.sleep(0.01)
    started: dict[int, Any] = dict(items.values_list("pk", "result"))
    return [float(started[pk]) - committed[pk] for pk in committed]


def run(
    target: Target,
    *,
    items: int,
    cold_starts: int,
    idle_seconds: float,
    compare_raw: bool,
    progress: Progress,
) -> dict[str, Any]:
    target.clear()
    progress.phase("wake-up: starting an idle consumer")
    consumer = IdleConsumer(target)
    idle_cpu = None
    try:
        latencies(target, WARM_UP)
        # Producers look consumers up once a second: past that, this one is known to all.
        time.sleep(local_wakeup.ADDRESS_CACHE_SECONDS)
        progress.phase(f"wake-up: {items} items {GAP * 1000:.0f} ms apart")
        samples = latencies(target, items)
        if idle_seconds > 0:
            progress.phase(f"wake-up: idle consumer CPU over {idle_seconds:.0f} s")
            time.sleep(IDLE_SETTLE)
            cpu_then, clock_then = consumer.cpu_seconds(), time.monotonic()
            time.sleep(idle_seconds)
            cpu_now = consumer.cpu_seconds()
            if cpu_then is not None and cpu_now is not None:
                idle_cpu = 100 * (cpu_now - cpu_then) / (time.monotonic() - clock_then)
    finally:
        consumer.stop()
    cold = []
    for n in range(cold_starts):
        # Spread over the consumer's first second: its idle wait doubles from 50 ms.
        offset = n / cold_starts
        progress.phase(f"wake-up: cold start {n + 1}/{cold_starts}, {offset * 1000:.0f} ms in")
        consumer = IdleConsumer(target)
        try:
            time.sleep(offset)
            cold += latencies(target, 1)
        finally:
            consumer.stop()
    target.clear()
    baseline = claim = None
    if compare_raw:
        progress.phase(f"wake-up: {wakeup_baseline_label(target)}")
        baseline = latency(wakeup_round_trips(target, items, WARM_UP, GAP))
        progress.phase("wake-up: hand-written claim statements")
        claim = latency(claim_statements(target, items, WARM_UP, GAP))
    ours = latency(samples)
    return {
        "items": items,
        "gap_ms": GAP * 1000,
        "latency": ours,
        "cold_start": latency(cold),
        "baseline": baseline,
        "baseline_label": wakeup_baseline_label(target),
        "claim_statement": claim,
        "percent": percent(ours["p50_ms"], baseline["p50_ms"]) if ours and baseline else None,
        "idle_cpu_percent": idle_cpu,
    }
