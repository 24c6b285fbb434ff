"""Health probes: is the queue's database reachable, are this host's consumers
heartbeating, has a queue's oldest due item waited too long. ``txqueue_health`` (exit
status and one line) and the JSON view (``django_txqueue.urls``) both run these.

Each check is a few indexed reads: the database's list of tables, the ``Consumer`` rows of
one host, and the oldest due item per queue from the READY index (the dashboard's read;
never a COUNT). Times are the database's clock, as everywhere else.
"""

from __future__ import annotations

import datetime as dt
import os
import socket
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from django.db import DatabaseError
from django.db.models import DurationField, ExpressionWrapper, F
from django.db.models.functions import Now
from django.http import HttpRequest, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from ..api import items_database, queue_databases
from ..consumer import readiness
from ..models import Consumer, QueueItem, QueuePause
from . import reads
from .logs import counted, one_line


@dataclass
class Check:
    """One check's verdict: ``name`` is "database", "heartbeat" or "ready_age"; ``detail``
    is the sentence the command prints; ``counts`` are numbers a dashboard may plot."""

    name: str
    healthy: bool
    detail: str
    counts: dict[str, Any] = field(default_factory=dict)


def check_databases(aliases: Sequence[str], *, secret: bool = False) -> list[Check]:
    """Each alias answers and has the app's tables. With ``secret`` the driver's message
    (which may name a host or a user) stays out of the detail."""
    checks = []
    for alias in aliases:
        why, missing = readiness.probe(alias)
        if why is not None:
            why = "unreachable" if secret else f"unreachable: {why}"
        elif missing:
            why = f"not migrated ({len(missing)} tables missing)"
        detail = f"database {alias!r} {why or 'reachable'}"
        checks.append(Check("database", why is None, detail, {"database": alias}))
    return checks


def running(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (in this PID namespace)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's: it exists
        return True
    return True


def local_consumers(aliases: Sequence[str], host: str, pid: int | None) -> list[Consumer]:
    """The consumers running on this host: rows of ``host`` not marked stopped whose
    process exists, the latest started per OS pid (a container restarted in place gets
    pid 1 again; its killed predecessor's row stays behind, never stopped)."""
    latest: dict[tuple[str, int], Consumer] = {}
    for alias in aliases:
        rows = Consumer.objects.using(alias).filter(host=host, stopped_at__isnull=True)
        if pid is not None:
            rows = rows.filter(os_pid=pid)
        aged = rows.annotate(
            age=ExpressionWrapper(Now() - F("last_heartbeat_at"), output_field=DurationField())
        )
        for consumer in aged.order_by("started_at", "pk"):
            latest[(alias, consumer.os_pid)] = consumer
    return [consumer for consumer in latest.values() if running(consumer.os_pid)]


def check_heartbeats(
    aliases: Sequence[str], max_age: float, *, host: str | None = None, pid: int | None = None
) -> Check:
    """This host's running consumers (``pid``'s only, when given) all heartbeat within
    ``max_age`` seconds, and there is at least one."""
    host = host or socket.gethostname()
    consumers = local_consumers(aliases, host, pid)
    whose = f"pid {pid}" if pid is not None else f"host {host}"
    if not consumers:
        return Check("heartbeat", False, f"no consumer running on {whose}", {"consumers": 0})
    ages = [max(consumer.age.total_seconds(), 0.0) for consumer in consumers]  # type: ignore[attr-defined]
    stale = [age for age in ages if age > max_age]
    counts = {"consumers": len(ages), "stale": len(stale), "oldest_heartbeat_s": max(ages)}
    if stale:
        detail = (
            f"{len(stale)} of {counted(len(ages), 'consumer')} on {whose} silent for "
            f"{max(stale):.0f} s (over {max_age:g} s)"
        )
        return Check("heartbeat", False, detail, counts)
    detail = (
        f"{counted(len(ages), 'consumer')} on {whose} heartbeating (oldest {max(ages):.0f} s ago)"
    )
    return Check("heartbeat", True, detail, counts)


def check_any_heartbeat(aliases: Sequence[str], max_age: float) -> Check:
    """At least one consumer, on any host, heartbeat within ``max_age`` seconds: the JSON
    view's check, which runs on a web server rather than a consumer's host."""
    recent = Now() - dt.timedelta(seconds=max_age)
    live = sum(
        Consumer.objects.using(alias)
        .filter(stopped_at__isnull=True, last_heartbeat_at__gte=recent)
        .count()
        for alias in aliases
    )
    if not live:
        detail = f"no consumer heartbeat within {max_age:g} s"
        return Check("heartbeat", False, detail, {"consumers": 0})
    detail = f"{counted(live, 'consumer')} heartbeating within {max_age:g} s"
    return Check("heartbeat", True, detail, {"consumers": live})


def check_ready_age(aliases: Sequence[str], max_age: float, queues: Sequence[str] = ()) -> Check:
    """The oldest due item of each queue (of ``queues``, else of every queue with one)
    has waited at most ``max_age`` seconds past its ``run_at``. Paused queues are left
    out: their items wait on purpose."""
    homes: dict[str, list[str]] = {}
    if queues:
        for name in dict.fromkeys(queues):
            homes.setdefault(items_database(name), []).append(name)
    else:
        homes = {alias: [] for alias in aliases}
    ages: dict[str, float] = {}
    for alias, names in homes.items():
        items = QueueItem.objects.using(alias)
        paused = set(QueuePause.objects.using(alias).values_list("queue", flat=True))
        for name, waited in reads.oldest_ready_ages(items, names).items():
            if name not in paused:
                ages[name] = max(ages.get(name, 0.0), waited.total_seconds())
    late = {name: age for name, age in ages.items() if age > max_age}
    oldest = max(ages.values(), default=0.0)
    counts = {"queues": len(ages), "late": len(late), "oldest_ready_age_s": oldest}
    if late:
        name, age = max(late.items(), key=lambda pair: pair[1])
        others = f" and {len(late) - 1} more" if len(late) > 1 else ""
        waiting = f"oldest due item waiting {age:.0f} s (over {max_age:g} s)"
        detail = f"queue {name!r}{others}: {waiting}"
        return Check("ready_age", False, detail, counts)
    if not ages:
        return Check("ready_age", True, "no due items waiting", counts)
    name, age = max(ages.items(), key=lambda pair: pair[1])
    detail = f"oldest due item waiting {age:.0f} s ({name!r}, at most {max_age:g} s)"
    return Check("ready_age", True, detail, counts)


def run(
    *,
    databases: Sequence[str] = (),
    max_heartbeat_age: float | None = None,
    any_host: bool = False,
    consumer_pid: int | None = None,
    max_ready_age: float | None = None,
    queues: Sequence[str] = (),
    secret: bool = False,
) -> list[Check]:
    """The checks asked for, the databases' first: when one does not answer, the checks
    that would read it are not run (the probe is already unhealthy, and says why)."""
    aliases = list(databases) or queue_databases()
    checks = check_databases(aliases, secret=secret)
    if not all(check.healthy for check in checks):
        return checks
    try:
        if max_heartbeat_age is not None:
            if any_host:
                checks.append(check_any_heartbeat(aliases, max_heartbeat_age))
            else:
                checks.append(check_heartbeats(aliases, max_heartbeat_age, pid=consumer_pid))
        if max_ready_age is not None:
            checks.append(check_ready_age(aliases, max_ready_age, queues))
    except DatabaseError as exc:  # lost between the checks: unhealthy, on one line still
        why = "" if secret else f": {one_line(exc)}"
        checks.append(Check("database", False, f"database error{why}"))
    return checks


def summary(checks: Sequence[Check]) -> str:
    """The probe's one line: "ok: ..." with every check's detail, or "unhealthy: ..."
    with the failing ones'."""
    failing = [check.detail for check in checks if not check.healthy]
    if failing:
        return "unhealthy: " + "; ".join(failing)
    return "ok: " + "; ".join(check.detail for check in checks)


def report(checks: Sequence[Check]) -> dict[str, Any]:
    """The JSON view's body (and ``txqueue_health --json``'s)."""
    return {
        "healthy": all(check.healthy for check in checks),
        "summary": summary(checks),
        "checks": [asdict(check) for check in checks],
    }


def _seconds(request: HttpRequest, name: str) -> float | None:
    value = request.GET.get(name)
    if value is None:
        return None
    seconds = float(value)
    if not 0 <= seconds <= 10**7:
        raise ValueError(f"{name} must be a number of seconds from 0 to 10000000")
    return seconds


@never_cache
@require_GET
def health_view(request: HttpRequest) -> JsonResponse:
    """``GET .../health/[?max_heartbeat_age=S][&max_ready_age=S][&queue=NAME...]``: 200
    with ``{"healthy": true, ...}``, or 503 with the reason. Unauthenticated on purpose
    (load balancers and kubelets probe without credentials): it tells databases' aliases,
    queue names and counts, never a payload, a driver's message or a host name."""
    try:
        heartbeat = _seconds(request, "max_heartbeat_age")
        ready = _seconds(request, "max_ready_age")
    except ValueError as exc:
        return JsonResponse({"healthy": False, "error": str(exc)}, status=400)
    checks = run(
        max_heartbeat_age=heartbeat,
        any_host=True,
        max_ready_age=ready,
        queues=request.GET.getlist("queue"),
        secret=True,
    )
    body = report(checks)
    return JsonResponse(body, status=200 if body["healthy"] else 503)
