"""Checks on what callers pass in: queue names, labels, integers, JSON, times.

Pure functions with no models and no queries, so that every entry point (the API, the
settings checks, the Tasks backend, the commands) rejects bad input the same way,
before anything is written.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from cronsim import CronSim, CronSimError
from django.conf import settings
from django.core.serializers.json import DjangoJSONEncoder
from django.utils import timezone

MAX_QUEUE_NAME = 100  # QueueItem.queue's max_length
MAX_LABEL = 255  # key and dedup_key
INT_RANGE = (-(2**31), 2**31 - 1)
# What an item does when an item it waits for fails: end CANCELLED, or run anyway.
AFTER_FAILURE = ("cancel", "run")


@dataclass(frozen=True)
class Rate:
    """A rate limit: at most ``limit`` claims in any ``period`` seconds."""

    limit: int
    period: int

    def __str__(self) -> str:
        return f"{self.limit}/{_PERIOD_NAMES[self.period]}"

    @property
    def per(self) -> str:
        """The period in words: "a second", "a minute", "an hour"."""
        return {1: "a second", 60: "a minute", 3600: "an hour"}[self.period]


_PERIODS = {"s": 1, "m": 60, "h": 3600}
_PERIOD_NAMES = {seconds: name for name, seconds in _PERIODS.items()}
_RATE = re.compile(r"\s*([0-9]+)\s*/\s*([smh])\s*")


@functools.cache
def parse_rate(value: str) -> Rate:
    """``"50/s"``, ``"10/m"``, ``"1000/h"`` as a ``Rate``; a ValueError names the problem."""
    match = _RATE.fullmatch(value) if isinstance(value, str) else None
    if match is None or int(match[1]) < 1:
        raise ValueError(
            f"a rate limit is 'N/s', 'N/m' or 'N/h' with N a positive integer, got {value!r}"
        )
    return Rate(int(match[1]), _PERIODS[match[2]])


def queue_name_problem(name: Any) -> str | None:
    """Why ``name`` cannot be a queue name, or None if it can."""
    if not isinstance(name, str):
        return f"a queue name must be a string, not {type(name).__name__}"
    if not 1 <= len(name) <= MAX_QUEUE_NAME:
        return f"a queue name must be 1 to {MAX_QUEUE_NAME} characters, got {len(name)}: {name!r}"
    return None


def validate_queue_name(name: Any) -> str:
    problem = queue_name_problem(name)
    if problem is None:
        return str(name)
    raise (TypeError if not isinstance(name, str) else ValueError)(problem)


def item_values(
    queue: str,
    payload: Any,
    *,
    priority: int,
    run_at: datetime | None,
    delay: float | timedelta | None,
    key: str | None,
    dedup_key: str | None,
    max_attempts: int,
    after_failure: str = "cancel",
) -> dict[str, Any]:
    """The checked fields of a new item of ``queue`` with ``enqueue``'s options, but the
    payload, which is checked as JSON (one item's, or a list of many's, at once):
    ``run_at`` only when given, a ``delay`` as a timedelta under ``"delay"`` (the caller
    adds it to the database clock)."""
    check_json(payload, f"payload for queue {queue!r}")
    validate_int(priority, "priority", *INT_RANGE)
    if run_at is not None and delay is not None:
        raise ValueError("pass run_at or delay, not both")
    values: dict[str, Any] = {
        "queue": queue,
        "priority": priority,
        "key": validate_label(key, "key"),
        "dedup_key": validate_label(dedup_key, "dedup_key"),
        "max_attempts": validate_int(max_attempts, "max_attempts", 1),
    }
    if run_at is not None:
        values["run_at"] = validate_run_at(run_at)
    elif delay is not None:
        values["delay"] = to_timedelta(delay, "delay")
    if after_failure not in AFTER_FAILURE:
        raise ValueError(f"after_failure must be 'cancel' or 'run', got {after_failure!r}")
    if after_failure == "run":
        values["runs_after_failure"] = True
    return values


# A process enqueues into a few queues, each many times: their names are checked once.
# Unhashable names (a list) make the cache raise TypeError: call validate_queue_name then.
checked_queue_name = functools.lru_cache(maxsize=1024)(validate_queue_name)


def validate_label(value: Any, what: str) -> str | None:
    """``key`` and ``dedup_key``: None, or a string of 1 to 255 characters."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a string, not {type(value).__name__}")
    if not 1 <= len(value) <= MAX_LABEL:
        raise ValueError(f"{what} must be 1 to {MAX_LABEL} characters, got {len(value)}")
    return value


def validate_int(value: Any, what: str, low: int, high: int = INT_RANGE[1]) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{what} must be between {low} and {high}, got {value}")
    return value


def validate_pid(pid: Any) -> str | None:
    if pid is not None and (not isinstance(pid, str) or not 1 <= len(pid) <= 255):
        raise ValueError(f"pid must be a string of 1 to 255 characters, got {pid!r}")
    return pid


def check_json(value: Any, what: str, error: type[TypeError] = TypeError) -> None:
    """Raise ``error`` naming the type that Django's JSON encoder cannot serialise.

    The message keeps Python's own wording ("Object of type set is not JSON
    serializable"), so that searching for the usual error finds it.
    """
    try:
        json.dumps(value, cls=DjangoJSONEncoder)
    except (TypeError, ValueError) as exc:
        raise error(f"{what}: {exc}") from exc


def to_timedelta(value: float | timedelta, name: str) -> timedelta:
    """Accept seconds (int or float) or a timedelta, as ``lease`` and ``delay`` do."""
    if isinstance(value, timedelta):
        result = value
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        result = timedelta(seconds=value)
    else:
        raise TypeError(f"{name} must be seconds (int or float) or a timedelta, not {value!r}")
    if result < timedelta(0):
        raise ValueError(f"{name} must not be negative, got {value!r}")
    return result


def validate_run_at(run_at: Any) -> datetime:
    if not isinstance(run_at, datetime):
        raise TypeError(f"run_at must be a datetime, not {type(run_at).__name__}")
    if settings.USE_TZ and timezone.is_naive(run_at):
        raise ValueError(
            f"run_at {run_at!r} is naive while USE_TZ is on; pass an aware datetime "
            "(e.g. django.utils.timezone.now() + timedelta(...))"
        )
    if not settings.USE_TZ and timezone.is_aware(run_at):
        return timezone.make_naive(run_at)
    return run_at


def cron_problem(expression: Any) -> str | None:
    """Why ``expression`` is not a cron expression cronsim evaluates, or None."""
    if not isinstance(expression, str):
        return f"a cron expression is a string, not {type(expression).__name__}"
    try:
        CronSim(expression, datetime.now(UTC))
    except CronSimError as exc:
        return f"{expression!r} is not a cron expression: {exc}"
    return None
