"""The walk of one item through the package's modules (docs/architecture.md, "The walk"):
which module each call enters, in order, so that a test can hold that an enqueue, and a
claim with its handler and acknowledgement, enter every module at most once and never
climb back to one they left.

``tests/test_architecture.py`` holds them; ``python3 scripts/test.py -s -k walk`` prints them.
"""

from __future__ import annotations

import dis
import inspect
import re
import sys
import threading
from collections import Counter
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import django_txqueue

PACKAGE = Path(django_txqueue.__file__).resolve().parent


def module_of(filename: str) -> str | None:
    """The package module a frame runs in (``consumer/worker.py`` as ``consumer.worker``),
    or None outside the package and in its migrations."""
    try:
        relative = Path(filename).resolve().relative_to(PACKAGE)
    except ValueError:
        return None
    if "migrations" in relative.parts:
        return None
    parts = relative.with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts) or "__init__"


SUSPENDS = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


@cache
def start_offset(code) -> int:
    """Where a generator's frame starts running (its first ``RESUME``; -1 before Python
    3.11): a profile "call" event at any other offset resumes it, at a ``yield``."""
    return next((i.offset for i in dis.get_instructions(code) if i.opname == "RESUME"), -1)


def resumed(frame) -> bool:
    """Whether this "call" resumes a suspended generator (a context manager's exit, an
    iterator's next value): the visit its start began goes on, nothing is entered."""
    return bool(frame.f_code.co_flags & SUSPENDS) and frame.f_lasti > start_offset(frame.f_code)


def own_method(frame, caller) -> bool:
    """Whether this is a method of the caller's own object (``self.lease_param`` from a
    ``Dialect`` method of the base class, run by the vendor's override): the object's
    class is one room however its methods are spread over base and subclass. ``caller``:
    the package frame the call came from, through any of Django's or contextlib's."""
    if caller is None or "self" not in frame.f_code.co_varnames[:1]:
        return False
    mine = frame.f_locals.get("self")
    return mine is not None and mine is caller.f_locals.get("self")


def thread_role() -> str:
    """The current thread's name without its number: ``MainThread``, ``txqueue-handler``,
    ``txqueue-housekeeping``."""
    return re.sub(r"[-_]\d+$", "", threading.current_thread().name)


class Walk:
    """The modules entered, in order: a call into a package module from a frame of another
    module (or from outside the package) enters it. Calls within a module, calls of an
    object's own methods (``own_method``), returns, and the resumption of a generator (a
    ``with`` block's end) enter nothing. Each entry is
    noted with its thread's role (``by_thread``): a thread is a walk of its own."""

    def __init__(self) -> None:
        self.entered: list[str] = []
        self.entries: list[tuple[str, bool]] = []  # (module, whether from outside)
        self.by_thread: list[tuple[str, str]] = []
        self._modules: dict[str, str | None] = {}

    def _module(self, filename: str) -> str | None:
        if filename not in self._modules:
            self._modules[filename] = module_of(filename)
        return self._modules[filename]

    def __call__(self, frame, event, arg):
        if event != "call":
            return
        module = self._module(frame.f_code.co_filename)
        if module is None:
            return
        caller = frame.f_back
        while caller is not None and self._module(caller.f_code.co_filename) is None:
            # Django's code between two of ours (a manager, a signal): the module that
            # called into Django is the one this call comes from.
            caller = caller.f_back
        came_from = None if caller is None else self._module(caller.f_code.co_filename)
        if came_from != module and not resumed(frame) and not own_method(frame, caller):
            self.entered.append(module)
            self.entries.append((module, came_from is None))
            self.by_thread.append((thread_role(), module))

    def repeated(self) -> dict[str, int]:
        """The modules entered more than once from the package, and how often. A call
        from outside (the caller's own, or one Django makes at the caller's commit, an
        ``on_commit`` callback) starts a walk of its own."""
        inside = Counter(module for module, outside in self.entries if not outside)
        return {name: n for name, n in inside.items() if n > 1}

    def path(self) -> list[str]:
        """The modules in the order first entered."""
        return list(dict.fromkeys(self.entered))


@contextmanager
def walking():
    """Record the walk of this thread and of the threads started meanwhile."""
    walk = Walk()
    sys.setprofile(walk)
    threading.setprofile(walk)
    try:
        yield walk
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


def walks() -> dict[str, Walk]:
    """One enqueue, then one claim with its handler and acknowledgement by a consumer
    (``Worker`` in burst mode, one thread, the items' queue only): their walks. Needs a
    migrated database; leaves the queue's items behind."""
    from django.db import transaction

    from django_txqueue import enqueue
    from django_txqueue.consumer import registry
    from django_txqueue.consumer.worker import Worker

    queue = "walk"
    registry.handler(queue)(lambda item: None)
    try:
        enqueue(queue, {"warm": True})  # compiled statements and lazy imports, once
        Worker({queue: registry.handlers()[queue]}, burst=True).run()
        with walking() as producing, transaction.atomic():
            enqueue(queue, {"n": 1})
        with walking() as consuming:
            Worker({queue: registry.handlers()[queue]}, burst=True).run()
    finally:
        registry.unregister(queue)
    return {"enqueue": producing, "claim, handle, acknowledge": consuming}


def entries_per_batch(few: int = 20, many: int = 60) -> dict[tuple[str, str], float]:
    """How often each thread of a consumer (by role: ``thread_role``) enters each module
    per batch of one item, start-up and shutdown left out: the entries of a burst drain of
    ``many`` items less those of one of ``few``, over the difference, keyed by (thread
    role, module). A module a thread's walk goes through once per batch enters 1.0; more
    is control handed back and forth. Timers (the heartbeat) count too, so a slow machine
    may show a little of them."""
    from django_txqueue import enqueue_many
    from django_txqueue.consumer import registry
    from django_txqueue.consumer.worker import Worker

    queue = "walk-batches"
    registry.handler(queue)(lambda item: None)
    try:
        counts = []
        for items in (few, few, many):  # the first run warms up, uncounted
            enqueue_many(queue, [{}] * items)
            with walking() as walk:
                Worker({queue: registry.handlers()[queue]}, batch=1, burst=True).run()
            counts.append(Counter(walk.by_thread))
    finally:
        registry.unregister(queue)
    fewer, more = counts[1], counts[2]
    return {name: (more[name] - fewer[name]) / (many - few) for name in more | fewer}
