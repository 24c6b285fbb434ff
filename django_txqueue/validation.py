"""Checks on what callers pass in: queue names, labels, integers, JSON, times.

Pure functions with no models and no queries, so that every entry point (the API, the
settings checks, the Tasks backend, the commands) rejects bad input the same way,
before anything is written.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.core.serializers.json import DjangoJSONEncoder
from django.utils import timezone

MAX_QUEUE_NAME = 100  # QueueItem.queue's max_length
MAX_LABEL = 255  # key and dedup_key
INT_RANGE = (-(2**31), 2**31 - 1)


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
