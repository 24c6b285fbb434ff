"""The ``TXQUEUE`` setting: defaults, per-queue overrides, and typed accessors.

Every key is documented in docs/reference/settings.md (tests/test_docs.py checks that).
``checks.py`` validates the dict; this module only reads it, and re-reads it when a test
overrides the setting.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from datetime import timedelta
from types import MappingProxyType
from typing import Any

from django.conf import settings
from django.core.signals import setting_changed
from django.dispatch import receiver

DEFAULTS: dict[str, Any] = {
    # Database alias holding the queue tables; None means Django's router decides.
    "DATABASE": None,
    # Seconds a claim is leased for before the item counts as stuck.
    "LEASE": 300,
    # Attempts (claims) an item gets before it ends FAILED.
    "MAX_ATTEMPTS": 5,
    # Retry back-off: RETRY_DELAY * 2 ** (attempt - 1) seconds, capped, with jitter.
    "RETRY_DELAY": 10,
    "RETRY_MAX_DELAY": 3600,
    # Snoozes (``raise Snooze(seconds)``) an item gets without using an attempt.
    "MAX_SNOOZES": 10,
    # "auto", "skip_locked" or "update_limit" (docs/claims.md).
    "CLAIM_STRATEGY": "auto",
    # A consumer whose heartbeat is older than this many seconds is dead.
    "CONSUMER_TIMEOUT": 60,
    # Consumers: seconds between heartbeats (which also renew in-flight leases)...
    "HEARTBEAT_INTERVAL": 10,
    # ...between rescues of stuck items...
    "RESCUE_INTERVAL": 30,
    # ...between purges of finished items older than RETENTION...
    "PURGE_INTERVAL": 300,
    # ...the longest idle wait between polls (wake-ups cut it short)...
    "POLL_INTERVAL": 2,
    # ...and how long a stopping consumer lets in-flight handlers finish.
    "SHUTDOWN_TIMEOUT": 30,
    # Wake idle consumers on this host with a loopback datagram where the database has no
    # LISTEN/NOTIFY (MySQL, MariaDB, SQLite). Polling remains the fallback.
    "LOCAL_WAKEUP": True,
    # How long DONE and FAILED items are kept before consumers purge them: seconds or a
    # timedelta; None keeps them (purge with txqueue_purge instead).
    "RETENTION": timedelta(days=7),
    # Per-queue overrides: {"sms": {"LEASE": 30, "MAX_ATTEMPTS": 10}}.
    "QUEUES": {},
    # PostgreSQL: {queue database alias: alias consumers LISTEN through}, for queue
    # databases reached through a transaction pool (PgBouncer), which loses LISTEN; the
    # other alias connects directly or through a session pool (docs/scaling.md).
    "LISTEN_DATABASES": {},
    # Periodic items: {name: {"QUEUE": ..., "CRON": "0 3 * * *" | "EVERY": seconds, ...}},
    # enqueued by the consumers of their queue, each tick once (docs/control.md).
    "SCHEDULE": {},
    # A secret a Prometheus scraper sends as "Authorization: Bearer <token>" to read the
    # metrics view (django_txqueue.urls) without a staff login; None: staff only.
    "METRICS_TOKEN": None,
}

# Keys a queue may override, with the top-level key supplying the default (None:
# no top-level default). Lower-case spellings are accepted as well.
QUEUE_KEYS: dict[str, str | None] = {
    "LEASE": "LEASE",
    "MAX_ATTEMPTS": "MAX_ATTEMPTS",
    "MAX_SNOOZES": "MAX_SNOOZES",
    "MAX_SIZE": None,
    # Fair queues serve their keys in rounds; ordered ones run one item per key at a
    # time, in enqueue order (docs/queues.md).
    "FAIR": None,
    "ORDERED": None,
    # At most this many items per key running at once, the key's earliest (docs/queues.md).
    "MAX_IN_FLIGHT_PER_KEY": None,
    # At most this many of the queue's items running at once, across every consumer
    # (docs/limits.md).
    "MAX_IN_FLIGHT": None,
    # At most N items claimed in any second, minute or hour ("N/s", "N/m", "N/h"), across
    # every consumer: the queue's, and each key's (docs/limits.md).
    "RATE_LIMIT": None,
    "RATE_LIMIT_PER_KEY": None,
    "DATABASE": "DATABASE",
    # What a rescue does with a stuck item: "retry" (READY again) or "fail" (FAILED at once,
    # for work that must never run twice).
    "RESCUE": None,
    # Seconds a handler may run before its lease stops being renewed (None: no limit).
    "TIMEOUT": None,
    "RETENTION": "RETENTION",
}

STRATEGIES = ("auto", "skip_locked", "update_limit")


def user_settings() -> dict[str, Any]:
    """The raw ``TXQUEUE`` dict as the project wrote it (empty when unset)."""
    value = getattr(settings, "TXQUEUE", None)
    return value if isinstance(value, dict) else {}


@functools.cache
def _merged() -> dict[str, Any]:
    merged = {**DEFAULTS, **user_settings()}
    merged["QUEUES"] = {
        name: {str(key).upper(): value for key, value in (options or {}).items()}
        for name, options in (merged.get("QUEUES") or {}).items()
    }
    return merged


@receiver(setting_changed)
def _reload(setting: str, **kwargs: Any) -> None:
    if setting == "TXQUEUE":
        _merged.cache_clear()
        queue_options.cache_clear()


def get(key: str) -> Any:
    """A top-level setting, or its default."""
    return _merged()[key]


def queue_option(queue: str, key: str) -> Any:
    """A per-queue setting: the queue's override, else the top-level value."""
    overrides = _merged()["QUEUES"].get(queue, {})
    if key in overrides:
        return overrides[key]
    fallback = QUEUE_KEYS[key]
    return get(fallback) if fallback else None


@functools.cache
def queue_options(queue: str) -> Mapping[str, Any]:
    """Every per-queue key (``QUEUE_KEYS``) as ``queue`` has it (``queue_option``), read
    once until the setting changes: what an enqueue asks of its queue's settings."""
    return MappingProxyType({key: queue_option(queue, key) for key in QUEUE_KEYS})


def lease(queue: str | None = None) -> timedelta:
    """The lease a claim on ``queue`` gets when the caller names none (None: the
    top-level ``LEASE``, for tables without queues)."""
    return timedelta(seconds=get("LEASE") if queue is None else queue_option(queue, "LEASE"))


def lease_overrides() -> dict[str, timedelta]:
    """Queues whose ``LEASE`` differs from the top-level one."""
    default = get("LEASE")
    return {
        name: timedelta(seconds=options["LEASE"])
        for name, options in _merged()["QUEUES"].items()
        if options.get("LEASE", default) != default
    }


def retention(queue: str | None = None) -> timedelta | None:
    """How long ``queue``'s finished items are kept (None: the top-level ``RETENTION``),
    or None when they are kept until someone purges them."""
    value = get("RETENTION") if queue is None else queue_option(queue, "RETENTION")
    return _duration(value)


def effect_retention() -> timedelta | None:
    """How long ``once()`` records are kept: the longest retention of any item that could
    have made one, so a requeued item never repeats its effect (None: kept)."""
    values = [get("RETENTION")] + [
        options["RETENTION"] for options in _merged()["QUEUES"].values() if "RETENTION" in options
    ]
    durations = [_duration(value) for value in values]
    return None if None in durations else max(d for d in durations if d is not None)


def _duration(value: float | timedelta | None) -> timedelta | None:
    if value is None or isinstance(value, timedelta):
        return value
    return timedelta(seconds=value)
