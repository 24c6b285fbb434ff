"""The queue's guarantees, proven under faults on your database (``txqueue_chaos``).

It enqueues N items on its own queue, starts W consumer processes (``consumer.py``)
whose handler records every run in ``ChaosRun``, and then, round after round at random
moments, SIGKILLs a consumer (starting a replacement), SIGTERMs another (which must exit
0) and, given a restart command, restarts the database server. It also claims a few
items itself with a one-second lease and never acknowledges them; once consumers have
rescued and finished them, it calls ``ack()``, ``release()``, ``fail()`` and ``retry()`` on
its stale copies. ``verify.audit`` then checks the final rows and the runs.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import IO, Any

from django.db import connections
from django.utils import timezone

from django_txqueue import Consumer as ConsumerRow
from django_txqueue import Queue, QueueItem, Status, group, step, store
from django_txqueue.validation import parse_rate

from .models import ChaosRun
from .verify import History, Run, audit

STALE_ITEMS = 5
FLOW_STEPS = 100  # steps per group, with --flows
STALE_LEASE = 1.0  # seconds
# The consumers' settings: short leases and intervals, so that a run takes seconds.
HEARTBEAT, CONSUMER_TIMEOUT, RESCUE_INTERVAL = 0.5, 2.0, 0.5
DRAIN_TIMEOUT = 300.0  # seconds for the last items after the last round
STARTUP_TIMEOUT = 30.0  # seconds a consumer process may take to come up
LAST_WORDS = 15  # lines of a consumer's stderr quoted when it exits by itself


class RestartFailed(Exception):
    """The restart command failed: the run stops, its consumers stopped."""


@dataclass
class Options:
    alias: str
    queue: str
    items: int
    consumers: int
    rounds: int
    lease: float
    seed: int
    restart_command: str | None = None
    verbose: bool = False  # the consumers' own log on stderr
    # Flows (docs/flows.md): the items as groups of FLOW_STEPS steps, each with a then.
    flows: bool = False
    # The queue's RATE_LIMIT (docs/limits.md), checked against the handlers' starts.
    rate_limit: str | None = None


class Consumers:
    """The consumer processes, with their kills and SIGTERM exits."""

    def __init__(self, options: Options) -> None:
        queue: dict[str, Any] = {"LEASE": options.lease, "DATABASE": options.alias}
        if options.rate_limit is not None:
            queue["RATE_LIMIT"] = options.rate_limit
        settings = {
            "HEARTBEAT_INTERVAL": HEARTBEAT,
            "CONSUMER_TIMEOUT": CONSUMER_TIMEOUT,
            "RESCUE_INTERVAL": RESCUE_INTERVAL,
            "POLL_INTERVAL": 0.2,
            "DATABASE": options.alias,
            "QUEUES": {options.queue: queue},
        }
        # The project's directory (manage.py's, first on sys.path) goes on the consumers'
        # path too, so that they import its settings wherever the command was started.
        path = [os.path.abspath(sys.path[0] or os.curdir), os.environ.get("PYTHONPATH", "")]
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, path)),
            "TXQUEUE_CHAOS_SETTINGS": json.dumps(settings),
        }
        self.queue = options.queue
        self.verbose = options.verbose
        self.running: list[subprocess.Popen[bytes]] = []
        self.killed: dict[int, datetime] = {}  # os pid: when
        self.orphans: dict[int, datetime] = {}  # item id: when its consumer was killed
        self.alias = options.alias
        self.sigterm_exits: list[int] = []
        self.logs: dict[int, IO[bytes]] = {}  # os pid: its stderr
        for _ in range(options.consumers):
            self.start()

    def start(self) -> None:
        command = [sys.executable, "-m", "django_txqueue.contrib.chaos.consumer", self.queue]
        # Its stderr (rescues log there) goes to a file, whose end tells why it exited if
        # it ends by itself; with --verbosity 2, to the command's stderr instead.
        log = None if self.verbose else tempfile.TemporaryFile()  # noqa: SIM115 - closed by close()
        process = subprocess.Popen(  # noqa: S603
            command, env=self.env, stdout=subprocess.DEVNULL, stderr=log
        )
        self.running.append(process)
        if log is not None:
            self.logs[process.pid] = log

    def kill(self, rng: random.Random) -> None:
        """SIGKILL a consumer, note the items it held (identity host:os-pid:random),
        and start a replacement."""
        victim = self.running.pop(rng.randrange(len(self.running)))
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        killed_at = self.killed[victim.pid] = timezone.now()
        held = QueueItem.objects.using(self.alias).filter(
            queue=self.queue,
            status=Status.IN_PROGRESS,
            pid__startswith=f"{socket.gethostname()}:{victim.pid}:",
        )
        self.orphans.update(dict.fromkeys(held.values_list("pk", flat=True), killed_at))
        self.start()

    def terminate(self, victim: subprocess.Popen[bytes]) -> None:
        victim.send_signal(signal.SIGTERM)
        try:
            self.sigterm_exits.append(victim.wait(60))
        except subprocess.TimeoutExpired:
            victim.kill()
            self.sigterm_exits.append(-9)

    def up(self) -> list[subprocess.Popen[bytes]]:
        """The running consumers that are up: their Consumer row says so, written after
        their signal handlers are installed. One still starting has none yet, and a
        SIGTERM ends it with Python's default, -15."""
        live = set(
            ConsumerRow.objects.using(self.alias)
            .filter(os_pid__in=[p.pid for p in self.running], stopped_at__isnull=True)
            .values_list("os_pid", flat=True)
        )
        return [process for process in self.running if process.pid in live]

    def terminate_one(self, rng: random.Random) -> None:
        """SIGTERM a consumer that is up, and start a replacement."""
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while not (ready := self.up()) and time.monotonic() < deadline:
            time.sleep(0.1)
        victim = rng.choice(ready or self.running)
        self.running.remove(victim)
        self.terminate(victim)
        self.start()

    def stop(self) -> None:
        """SIGTERM every consumer, each once it is up: the drain can end while the last
        replacement is still starting."""
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            up = self.up()
            if all(process in up or process.poll() is not None for process in self.running):
                break
            time.sleep(0.1)
        while self.running:
            self.terminate(self.running.pop())

    def crashed(self) -> list[str]:
        """How the consumers that ended by themselves (none should) exited: the code and
        the last lines of their stderr."""
        return [
            f"a consumer exited by itself with code {code}{self.last_words(process.pid)}"
            for process in self.running
            if (code := process.poll()) is not None
        ]

    def last_words(self, pid: int) -> str:
        if (log := self.logs.get(pid)) is None:
            return ""
        log.seek(0)
        lines = log.read().decode(errors="replace").strip().splitlines()[-LAST_WORDS:]
        return "".join(f"\n    {line}" for line in lines)

    def close(self) -> None:
        for log in self.logs.values():
            log.close()


def run(options: Options, progress: Callable[[str], None]) -> dict[str, Any]:
    rng = random.Random(options.seed)  # noqa: S311 - a reproducible schedule, not secrecy
    queue = Queue(options.queue, using=options.alias)
    runs = ChaosRun.objects.using(options.alias).filter(queue=options.queue)
    store.delete_all(queue.items)
    runs.delete()
    flows = enqueue_items(queue, options)
    stale = queue.claim(STALE_ITEMS, pid="txqueue_chaos:stale", lease=STALE_LEASE)
    consumers = Consumers(options)
    downtimes = []
    began = time.monotonic()
    try:
        for number in range(options.rounds):
            # Spread the rounds over the drain: round k once about k/(rounds+1) is done.
            target = options.items * (number + rng.uniform(0.5, 1.0)) / (options.rounds + 1)
            deadline = time.monotonic() + DRAIN_TIMEOUT / options.rounds
            while options.items - left(queue) < target and time.monotonic() < deadline:
                time.sleep(0.1)
            consumers.kill(rng)
            time.sleep(rng.uniform(0.1, 0.5))
            consumers.terminate_one(rng)
            if options.restart_command:
                down = timezone.now()
                restart = subprocess.run(  # noqa: S603
                    shlex.split(options.restart_command), capture_output=True, text=True
                )
                if restart.returncode != 0:
                    raise RestartFailed(
                        f"--restart-command exited {restart.returncode}: "
                        f"{restart.stdout}{restart.stderr}"
                    )
                connections[options.alias].close()
                downtimes.append((down, timezone.now()))
            progress(f"round {number + 1}/{options.rounds}: {left(queue):,} items left")
        deadline = time.monotonic() + DRAIN_TIMEOUT
        while (remaining := left(queue)) and time.monotonic() < deadline:
            if crashed := consumers.crashed():
                break
            progress(f"draining: {remaining:,} items left")
            time.sleep(0.5)
    finally:
        crashed = consumers.crashed()
        consumers.stop()
        consumers.close()
    answers, changed = stale_calls(stale, options.alias)
    history = History(
        items={
            pk: (status, token)
            for pk, status, token in queue.items.values_list("pk", "status", "claim_token")
        },  # fmt: skip
        runs=[
            Run(*row)
            for row in runs.values_list(
                "item_id", "claim_token", "consumer", "started_at", "finished_at"
            )
        ],
        killed=consumers.killed,
        orphans=consumers.orphans,
        sigterm_exits=consumers.sigterm_exits,
        stale_answers=answers,
        stale_changed=changed,
        rescue_bound=options.lease + RESCUE_INTERVAL + CONSUMER_TIMEOUT + 1.0,
        downtimes=downtimes,
        flows=flows,
        rate=None if options.rate_limit is None else parse_rate(options.rate_limit),
    )
    report = audit(history)
    # First: a consumer that ended by itself ended the drain early, which explains the rest.
    report["violations"][:0] = crashed
    report.update(rounds=options.rounds, restarts=len(downtimes), seconds=time.monotonic() - began)
    return report


def enqueue_items(queue: Queue, options: Options) -> list[tuple[list[int], int]]:
    """The run's items: plain, or with ``--flows`` as groups of FLOW_STEPS steps, each
    with a then; returns the flows' (steps, then) primary keys."""
    flows = []
    for start in range(0, options.items, FLOW_STEPS if options.flows else 1000):
        numbers = range(start, min(start + (FLOW_STEPS if options.flows else 1000), options.items))
        if not options.flows:
            queue.enqueue_many([{"n": n} for n in numbers])
            continue
        steps = [step(queue.name, {"n": n}) for n in numbers]
        items = group(*steps, then=step(queue.name, {"then": start})).enqueue(using=queue.using)
        flows.append(([item.pk for item in items.items[:-1]], items.items[-1].pk))
    return flows


def left(queue: Queue) -> int:
    return queue.items.exclude(status=Status.DONE).count()


def stale_calls(stale: list[QueueItem], alias: str) -> tuple[dict[str, bool], list[int]]:
    """Each settling call on the stale copies, once consumers finished the items: every
    answer must be False, and no row may change."""
    before = {
        row[0]: row
        for row in QueueItem.objects.using(alias)
        .filter(pk__in=[item.pk for item in stale])
        .values_list("pk", "status", "claim_token", "attempts", "result")
    }
    answers = {"ack": False, "release": False, "fail": False, "retry": False}
    for item in stale:
        answers["ack"] |= item.ack()
        answers["release"] |= item.release()
        answers["fail"] |= item.fail("stale")
        answers["retry"] |= item.retry("stale")
    after = QueueItem.objects.using(alias).filter(pk__in=list(before))
    rows = after.values_list("pk", "status", "claim_token", "attempts", "result")
    changed = [row[0] for row in rows if row != before[row[0]]]
    return answers, changed
