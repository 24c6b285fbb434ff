"""Claims: ready items moved to IN_PROGRESS under a new claim (pid, fencing token, lease),
and the claim that carries the last batch's acknowledgement with it where the database
allows.
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.core.signals import setting_changed
from django.db import DatabaseError, connections, transaction
from django.dispatch import receiver

from .. import conf
from ..db import dialect, dialect_for
from ..db.acks import Ack, ack_statement
from ..db.base import Uncounted
from ..db.compiler import ClaimStatement, ClaimValues
from ..status import Status
from ..validation import to_timedelta, validate_pid
from .acks import ack_many, ack_waited_for
from .bounds import lock_bound
from .conflicts import retrying_conflicts
from .consumers import consumer_identity

if TYPE_CHECKING:
    from django.db.models import Model


def claim(
    statement: ClaimStatement,
    *,
    pid: str | None = None,
    strategy: str = "auto",
    lease: float | timedelta | None = None,
    after: tuple[Any, ...] | None = None,
) -> list[Any]:
    """Move up to ``statement.limit`` ready items to IN_PROGRESS under a new claim.

    The strategy is the caller's choice, else the setting's, else the database's best
    (``resolved_strategy``); ``lease`` None gives each item its queue's ``LEASE``.
    ``after``: only items that sort after it (``ClaimValues.after``).
    Outside a caller's transaction a claim that lost a race runs again; one that loses
    ``TRANSIENT_RETRIES`` races in a row claims nothing.
    """
    connection = connections[statement.alias]
    vendor = dialect(connection)
    if resolved_strategy(strategy, statement.alias) == "skip_locked":
        run = vendor.claim_skip_locked
    else:
        run = vendor.claim_update_limit
    values = claim_values(statement, pid, lease, after)
    # Lost a race (a deadlock, or on Galera another node's claim of the same rows
    # certified first): nothing was claimed, so claim again.
    try:
        return retrying_conflicts(run, statement.alias, statement, values)
    except DatabaseError as exc:
        if connection.in_atomic_block or not vendor.is_transient(exc):
            raise
        return []  # lost every race this turn: the caller claims again


@functools.cache
def resolved_strategy(strategy: str, alias: str) -> str:
    """``strategy`` ("auto": the setting's, then the database's best) as database
    ``alias`` runs it; asked once, until the settings change."""
    return dialect_for(alias).resolve_strategy(strategy, connections[alias])


@receiver(setting_changed)
def _settings_changed(setting: str, **kwargs: Any) -> None:
    if setting in ("TXQUEUE", "DATABASES"):
        resolved_strategy.cache_clear()


def rides_with_claims(strategy: str, alias: str) -> bool:
    """Whether claims of ``strategy`` on database ``alias`` carry the last batch's
    acknowledgement (``ack_and_claim``): a consumer then leaves its successes to them."""
    return resolved_strategy(strategy, alias) in dialect_for(alias).acks_while_claiming


def claim_values(
    statement: ClaimStatement,
    pid: str | None,
    lease: float | timedelta | None,
    after: tuple[Any, ...] | None = None,
) -> ClaimValues:
    """A new claim's pid (the caller's, checked, or this process's), fencing token,
    lease and where it starts. The lease is the caller's, else the statement's queue's
    ``LEASE``; a claim across queues gives each row its queue's (``lease_by_queue``)."""
    validate_pid(pid)
    by_queue: dict[str, timedelta] = {}
    if lease is None and statement.queue is None and statement.has_queues:
        by_queue = conf.lease_overrides()  # each row its queue's: a CASE in the claim
    duration = lease_of(statement.queue, lease)
    return ClaimValues(pid or consumer_identity(), secrets.randbits(63), duration, after, by_queue)


def lease_of(queue: str | None, given: float | timedelta | None = None) -> timedelta:
    """How long a claim of ``queue``'s items holds them: ``given`` (seconds or a timedelta,
    the caller's or ``run_queue_consumer --lease``), else the queue's ``LEASE`` (None: the
    top-level one). Claims and lease renewals both ask here."""
    if given is not None:
        return to_timedelta(given, "lease")
    return conf.lease(queue)


def ack_and_claim(
    statement: ClaimStatement,
    ack: Ack | None,
    *,
    pid: str | None = None,
    strategy: str = "auto",
    lease: float | timedelta | None = None,
    after: tuple[Any, ...] | None = None,
) -> tuple[int, list[Any]]:
    """``ack_many`` of ``ack`` (one claim's items; None: nothing to acknowledge), then
    ``claim``: together where the database can (skip_locked: one statement on PostgreSQL,
    one transaction on MySQL and MariaDB), else one after the other. Returns the number
    acknowledged and the claimed items."""
    connection = connections[statement.alias]
    vendor = dialect(connection)
    resolved = resolved_strategy(strategy, statement.alias)
    if ack is None or not (ack.results and resolved in vendor.acks_while_claiming):
        acked = 0 if ack is None else ack_many(statement.model, statement.alias, ack)
        return acked, claim(statement, pid=pid, strategy=resolved, lease=lease, after=after)
    values = claim_values(statement, pid, lease, after)
    acks = ack_statement(statement.model, statement.alias)
    try:
        run = vendor.ack_and_claim
        acked, items = retrying_conflicts(run, statement.alias, statement, values, acks, ack)
    except DatabaseError as exc:
        if connection.in_atomic_block or not vendor.is_transient(exc):
            raise
        # The claim kept losing races, and took the acknowledgement down with it.
        return ack_many(statement.model, statement.alias, ack), []
    except Uncounted:  # rolled back, claim and all: acknowledged alone, then a claim
        acked = ack_many(statement.model, statement.alias, replace(ack, dependents=None))
        return acked, claim(statement, pid=pid, strategy=resolved, lease=lease, after=after)
    waited_for = ack_waited_for(statement.model, statement.alias, ack, acked)
    if waited_for and not items:
        # Acknowledging items that others wait for may have released some (a flow's next
        # step), which the claim ran too early to see: one more look, so that a burst run
        # does not stop with them READY.
        items = claim(statement, pid=pid, strategy=resolved, lease=lease)
    return acked + waited_for, items


def claim_capped(
    statement: Callable[[int], ClaimStatement],
    queue: str,
    cap: int,
    limit: int,
    bound_model: type[Model],
    **options: Any,
) -> list[Any]:
    """``claim`` of at most ``limit`` items of ``queue``, which runs at most ``cap`` at
    once across every consumer (``MAX_IN_FLIGHT``): under its bound row's lock (as a
    bounded queue's producers take it), its running items are counted and the claim
    takes no more than the places left. Claims of the queue take turns, and a bounded
    queue's producers (the same lock) wait for that short transaction; acknowledgements
    and other queues' claims do not. ``statement(n)``: the queue's claim of n items."""
    alias = statement(1).alias
    return retrying_conflicts(
        _claim_capped, alias, statement, queue, cap, limit, bound_model, options
    )


def _claim_capped(
    statement: Callable[[int], ClaimStatement],
    queue: str,
    cap: int,
    limit: int,
    bound_model: type[Model],
    options: dict[str, Any],
) -> list[Any]:
    first = statement(1)
    with transaction.atomic(using=first.alias):
        lock_bound(bound_model, queue, first.alias)
        rows = first.model._base_manager.using(first.alias)
        running = rows.filter(queue=queue, status=Status.IN_PROGRESS).count()
        places = min(limit, cap - running)
        return claim(statement(places), **options) if places > 0 else []


def queues_with_due_items(model: type[Model], alias: str, names: list[str]) -> set[str]:
    """Which of the queues ``names`` on ``alias`` have a READY item due now, in one
    statement: what a consumer looks at before claiming from queues it knows nothing of."""
    return dialect_for(alias).queues_with_due_items(model, alias, names)
