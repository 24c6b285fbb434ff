"""What every peer's workload shares: the handler's record of what it ran, forked drains
timed from first start to last finish, and the wake-up harness."""

from __future__ import annotations

import multiprocessing
import queue as queue_module
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from typing import Any

import psycopg
from django.conf import settings
from django.db import connections

CHILD_TIMEOUT = 1200.0  # seconds a drain may take (django-tasks-db: minutes) before giving up
GAP = 0.020  # seconds between wake-up jobs
WARM_UP = 5  # uncounted wake-up jobs first

# What the no-op handlers of this process ran: job numbers during a drain, or (number,
# handler start) into ``starts`` during a wake-up. Module state, so forked workers have it.
handled: list[int] = []
starts: Any = None


def record(n: int) -> None:
    """Every peer's handler calls this, and nothing else."""
    if starts is not None:
        starts.put((n, time.time()))
    else:
        handled.append(n)


def conninfo() -> str:
    """The benchmark database, as a libpq connection string (from the Django settings)."""
    db = settings.DATABASES["default"]
    return psycopg.conninfo.make_conninfo(
        dbname=db["NAME"], user=db["USER"], host=db["HOST"], port=db["PORT"]
    )


def execute(statement: str) -> list[tuple[Any, ...]]:
    """One constant statement on a connection of its own, in autocommit; its rows."""
    with psycopg.connect(conninfo(), autocommit=True) as connection:
        cursor = connection.execute(statement)  # type: ignore[arg-type]
        return cursor.fetchall() if cursor.description else []


def connection_url() -> str:
    """The same, as a URL (asyncpg takes no libpq string)."""
    db = settings.DATABASES["default"]
    return f"postgresql://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"


@dataclass
class Drained:
    """One drain: items per second over first start to last finish, and what was wrong."""

    rate: float
    problems: list[str] = field(default_factory=list)


def _child(consume: Callable[[], None], start: Any, results: Any) -> None:
    start.wait()
    began = time.time()
    try:
        consume()
    except Exception as exc:  # reported, so that the parent neither hangs nor hides it
        results.put(("error", f"{type(exc).__name__}: {exc}"))
    else:
        results.put(("ok", handled, began, time.time()))


def fork_drain(consume: Callable[[], None], items: int, processes: int) -> Drained:
    """Fork ``processes`` workers running ``consume`` (which returns once the queue is
    empty), time them, and check that the handlers ran each of ``items`` jobs once."""
    connections.close_all()  # each child opens its own
    context = multiprocessing.get_context("fork")
    start, results = context.Event(), context.Queue()
    children = [
        context.Process(target=_child, args=(consume, start, results)) for _ in range(processes)
    ]
    for process in children:
        process.start()
    began = time.monotonic()
    start.set()
    reports: list[tuple[Any, ...]] = []
    while len(reports) < processes and time.monotonic() - began < CHILD_TIMEOUT:
        try:
            reports.append(results.get(timeout=0.5))
        except queue_module.Empty:
            if not any(process.is_alive() for process in children) and results.empty():
                break
    for process in children:
        if process.is_alive() and len(reports) < processes:
            process.kill()
        process.join()
    problems = [f"a worker failed: {r[1]}" for r in reports if r[0] == "error"]
    finished = [r for r in reports if r[0] == "ok"]
    if len(reports) < processes:
        problems.append(f"{processes - len(reports)} worker(s) died or timed out unreported")
    runs = Counter(n for report in finished for n in report[1])
    if missing := items - len(runs.keys() & set(range(items))):
        problems.append(f"{missing} job(s) never ran")
    if repeated := sum(1 for count in runs.values() if count > 1):
        problems.append(f"{repeated} job(s) ran more than once")
    rate = 0.0
    if finished:
        elapsed = max(r[3] for r in finished) - min(r[2] for r in finished)
        rate = sum(runs.values()) / elapsed if elapsed > 0 else 0.0
    return Drained(rate, problems)


Producer = Callable[[], AbstractContextManager[Callable[[int], float]]]


def enqueue_rates(
    producers: dict[str, Producer], count: int, rounds: int
) -> dict[str, list[float]]:
    """Each system's enqueue rate (jobs per second, one job per transaction, from one
    producer: the ``enqueue_one(n)`` its ``producer()`` yields), in ``rounds`` slices of
    ``count`` jobs, the systems taking turns slice by slice in an order that rotates:
    on a machine whose speed drifts from one minute to the next, each round's systems
    share its speed, so their ratios hold where single long runs do not."""
    rates: dict[str, list[float]] = {name: [] for name in producers}
    with ExitStack() as stack:
        enqueuers = {name: stack.enter_context(make()) for name, make in producers.items()}
        for enqueue_one in enqueuers.values():
            for n in range(-WARM_UP, 0):  # connections opened, statements cached
                enqueue_one(n)
        names = list(enqueuers)
        for round_ in range(rounds):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                started = time.perf_counter()
                for n in range(round_ * count, (round_ + 1) * count):
                    enqueuers[name](n)
                rates[name].append(count / (time.perf_counter() - started))
    return rates


def wakeup_latencies(
    run_forever: Callable[[], None], producer: Producer, samples: int
) -> list[float]:
    """Fork an idle worker running ``run_forever``; after ``WARM_UP`` jobs, enqueue
    ``samples`` jobs ``GAP`` apart with the ``enqueue_one(n)`` that ``producer()`` yields
    (entered after the fork, so that the worker shares none of its connections), which
    returns the job's commit time; handler start minus commit for each."""
    global starts
    connections.close_all()
    context = multiprocessing.get_context("fork")
    starts = context.Queue()
    worker = context.Process(target=run_forever)
    worker.start()

    def wait_for(count: int) -> dict[int, float]:
        started: dict[int, float] = {}
        deadline = time.monotonic() + 30
        while len(started) < count:
            try:
                n, at = starts.get(timeout=0.5)
            except queue_module.Empty:
                if not worker.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the idle worker ran {len(started)} of {count} jobs"
                    ) from None
                continue
            started[n] = at
        return started

    try:
        with producer() as enqueue_one:
            # One at a time, each waited for: the worker is up, listening and idle afterwards.
            for n in range(-WARM_UP, 0):
                enqueue_one(n)
                wait_for(1)
            time.sleep(1.0)
            committed = {}
            clock = time.monotonic()
            for n in range(samples):
                time.sleep(max(0.0, clock + n * GAP - time.monotonic()))
                committed[n] = enqueue_one(n)
            started = wait_for(samples)
            return [started[n] - committed[n] for n in range(samples)]
    finally:
        worker.terminate()
        worker.join(10)
        if worker.is_alive():
            worker.kill()
            worker.join()
        starts = None
