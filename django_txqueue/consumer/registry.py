"""Handlers: ``@handler("queue")`` registers the function that processes a queue.

Handlers live in ``queues.py`` modules of installed apps, imported by ``autodiscover()``
when a consumer starts, as the admin imports ``admin.py``. Other sources of handlers
register themselves with ``add_source``: the Django Tasks backend does, for its queues.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, TypeVar

from django.conf import settings
from django.utils.module_loading import autodiscover_modules, import_string

from ..validation import validate_queue_name

Handler = Callable[[Any], Any]
AsyncHandler = Callable[[Any], Awaitable[Any]]
H = TypeVar("H", bound=Handler)


class Source(Protocol):
    """Queues whose handler comes from elsewhere than ``@handler`` (Django Tasks)."""

    def handlers(self) -> dict[str, Handler]:
        """Queue name to handler, for the queues known by name."""
        ...

    def takes_any_queue(self) -> bool:
        """Whether queues nobody named may turn up (found by ``find``)."""
        ...

    def find(self, queue: str) -> Handler | None:
        """The handler for ``queue``, a queue with ready items that has none, or None."""
        ...

    def database(self, queue: str) -> str | None:
        """The alias this source keeps ``queue`` on, or None (not its queue, or the
        queue's own home)."""
        ...

    def databases(self) -> list[str]:
        """Every alias this source's queues may be on (queues found by ``find`` too)."""
        ...


Backoff = Callable[[int, BaseException], "float | timedelta"]


@dataclass(frozen=True)
class RetryRule:
    """What a handler's exception comes to, as ``@handler`` was told (docs/limits.md):
    FAILED at once for one of ``discard_on``, or, where ``retry_on`` is given, for one
    outside it; else a retry after ``backoff(attempt, exc)`` seconds (None: the queue's
    back-off)."""

    retry_on: tuple[type[BaseException], ...] | None = None
    discard_on: tuple[type[BaseException], ...] = ()
    backoff: Backoff | None = None

    def retries(self, exc: BaseException) -> bool:
        if isinstance(exc, self.discard_on):
            return False
        return self.retry_on is None or isinstance(exc, self.retry_on)


PLAIN_RULE = RetryRule()

_handlers: dict[str, Handler] = {}
_atomic: set[str] = set()
_rules: dict[str, RetryRule] = {}
_sources: list[Source] = []
_choosers: dict[Handler, Callable[[Any], AsyncHandler | None]] = {}


def handler(
    queue: str,
    *,
    atomic: bool = False,
    retry_on: type[BaseException] | tuple[type[BaseException], ...] | None = None,
    discard_on: type[BaseException] | tuple[type[BaseException], ...] = (),
    backoff: Backoff | None = None,
) -> Callable[[H], H]:
    """Register the decorated function as the handler of ``queue``.

    It receives the claimed ``QueueItem``; its return value (JSON) is stored as the
    item's ``result``; an exception means a retry with back-off, or FAILED once
    ``max_attempts`` are spent. With ``atomic``, it runs in a transaction on the queue's
    database that ends with the item's fenced acknowledgement: its writes commit with
    the acknowledgement, or roll back with it when the claim was taken over.

    ``discard_on`` (exception classes): such an exception ends the item FAILED at once;
    ``retry_on``: only these are retried, any other ends it FAILED at once;
    ``backoff(attempt, exc)``: the seconds (or timedelta) before the retry, in place of
    the queue's back-off. ``raise Snooze(seconds)`` runs it again later without using an
    attempt.
    """
    validate_queue_name(queue)
    if not isinstance(atomic, bool):
        raise TypeError(f"atomic must be True or False, not {atomic!r}")
    if backoff is not None and not callable(backoff):
        raise TypeError(f"backoff must be a callable (attempt, exc) -> seconds, not {backoff!r}")
    rule = RetryRule(
        None if retry_on is None else exception_classes(retry_on, "retry_on"),
        exception_classes(discard_on, "discard_on"),
        backoff,
    )

    def register(func: H) -> H:
        if atomic and inspect.iscoroutinefunction(func):
            raise TypeError(
                f"the {queue!r} handler is async: atomic=True needs a sync handler (async "
                "code has no transaction.atomic; docs/async.md)"
            )
        existing = _handlers.get(queue)
        if existing is not None and existing is not func:
            raise ValueError(
                f"queue {queue!r} already has a handler: "
                f"{existing.__module__}.{existing.__qualname__}"
            )
        _handlers[queue] = func
        if atomic:
            _atomic.add(queue)
        else:
            _atomic.discard(queue)
        if rule == PLAIN_RULE:
            _rules.pop(queue, None)
        else:
            _rules[queue] = rule
        return func

    return register


def exception_classes(value: Any, name: str) -> tuple[type[BaseException], ...]:
    """``value``, an exception class or a tuple of them, as a tuple; TypeError naming
    ``name`` otherwise."""
    classes = value if isinstance(value, tuple) else (value,)
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, BaseException)):
            raise TypeError(
                f"{name} takes exception classes (one, or a tuple of them), not {cls!r}"
            )
    return classes


def retry_rule(queue: str) -> RetryRule:
    """How ``queue``'s handler wants its exceptions settled (``PLAIN_RULE``: retried
    with the queue's back-off)."""
    return _rules.get(queue, PLAIN_RULE)


def autodiscover() -> None:
    """Import every installed app's ``queues`` module, registering its handlers, and the
    Django Tasks backends named in ``TASKS``, which register their queues (``add_source``).
    """
    autodiscover_modules("queues")
    tasks = getattr(settings, "TASKS", None)
    for params in tasks.values() if isinstance(tasks, dict) else ():
        path = params.get("BACKEND") if isinstance(params, dict) else None
        if isinstance(path, str):
            with contextlib.suppress(ImportError):  # Django reports it when it is used
                import_string(path)


def add_source(source: Source) -> None:
    """Take handlers from ``source`` too (once, however often it is added)."""
    if source not in _sources:
        _sources.append(source)


def handlers() -> dict[str, Handler]:
    """Queue name to handler: the sources' (Django Tasks queues), then ``@handler``'s."""
    found: dict[str, Handler] = {}
    for source in _sources:
        found.update(source.handlers())
    return {**found, **_handlers}


def takes_any_queue() -> bool:
    """Whether a source may find handlers for queues nobody named (``find``)."""
    return any(source.takes_any_queue() for source in _sources)


def find(queue: str) -> Handler | None:
    """A source's handler for ``queue``, which has ready items and no handler yet; or None."""
    for source in _sources:
        found = source.find(queue)
        if found is not None:
            return found
    return None


def database(queue: str) -> str | None:
    """The alias a source keeps ``queue`` on (a Tasks backend's ``DATABASE``), or None."""
    for source in _sources:
        if (found := source.database(queue)) is not None:
            return found
    return None


def databases() -> list[str]:
    """Every alias the sources' queues may be on."""
    return list(dict.fromkeys(alias for source in _sources for alias in source.databases()))


def choose_coroutine(handle: Handler, choose: Callable[[Any], AsyncHandler | None]) -> None:
    """Let ``choose(item)`` say, item by item, which coroutine function runs an item of
    ``handle``'s queues in its place (None: ``handle`` runs it): the Tasks backend's
    ``run_task`` has ``async def`` tasks among its items."""
    _choosers[handle] = choose


def chooser(handle: Handler) -> Callable[[Any], AsyncHandler | None] | None:
    """How to find the coroutine function that runs an item of ``handle``'s: an ``async
    def`` handler runs every item as a coroutine; None: never one."""
    if inspect.iscoroutinefunction(handle):
        return lambda item: handle
    return _choosers.get(handle)


def is_atomic(queue: str) -> bool:
    """Whether ``queue``'s handler was registered with ``atomic=True``."""
    return queue in _atomic


def unregister(queue: str) -> None:
    """Forget a queue's handler (for tests)."""
    _handlers.pop(queue, None)
    _atomic.discard(queue)
    _rules.pop(queue, None)
