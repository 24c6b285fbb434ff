"""Claims: ready items moved to IN_PROGRESS under a new claim (pid, fencing token, lease),
and the claim that carries the last batch's acknowledgement with it where the database
allows.
"""

from __future__ import annotations

import functools
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
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
from ..validation import Rate, parse_rate, to_timedelta, validate_pid
from . import rates
from .acks import ack_many, ack_waited_for, unclaim
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


@dataclass(frozen=True)
class Limits:
    """What bounds a queue's claims across every consumer (docs/limits.md): at most
    ``cap`` items running at once (``MAX_IN_FLIGHT``), ``rate`` claimed in any period
    (``RATE_LIMIT``), ``per_key`` of each key (``RATE_LIMIT_PER_KEY``)."""

    cap: int | None = None
    rate: Rate | None = None
    per_key: Rate | None = None

    def __bool__(self) -> bool:
        return self.cap is not None or self.rate is not None or self.per_key is not None

    @classmethod
    def of(cls, queue: str) -> Limits:
        """``queue``'s limits as its settings give them (checked by ``manage.py check``)."""
        rate, per_key = (conf.queue_option(queue, key) for key in RATE_KEYS)
        return cls(
            conf.queue_option(queue, "MAX_IN_FLIGHT"),
            None if rate is None else parse_rate(rate),
            None if per_key is None else parse_rate(per_key),
        )


RATE_KEYS = ("RATE_LIMIT", "RATE_LIMIT_PER_KEY")


def claim_limited(
    statement: Callable[[int], ClaimStatement],
    queue: str,
    limits: Limits,
    limit: int,
    *,
    bounds: type[Model],
    rates: type[Model],
    **options: Any,
) -> tuple[list[Any], float | None]:
    """``claim`` of at most ``limit`` items of ``queue`` within its cap and its keys' rate
    limit, in one transaction: with a cap, under the queue's ``bounds`` row's lock (as a
    bounded queue's producers take it), its running items counted first; per key, each
    claimed key's budget (its ``rates`` row) locked and counted after the claim, whose
    items over it go back READY at once, their attempt uncounted (the claim reads past
    keys whose budget is spent). Claims of the queue take turns on the bound row, and
    those of one key on its row; acknowledgements and other queues' claims do not wait.
    ``statement(n)``: the queue's claim of n items. (The queue's own ``RATE_LIMIT`` is
    the caller's: ``rates.Allowance``.)

    Returns the items and, when no key had room left, the seconds until the first has
    (None otherwise)."""
    alias = statement(1).alias
    return retrying_conflicts(
        _claim_limited, alias, statement, queue, limits, limit, bounds, rates, options
    )


def _claim_limited(
    statement: Callable[[int], ClaimStatement],
    queue: str,
    limits: Limits,
    limit: int,
    bounds: type[Model],
    rates_model: type[Model],
    options: dict[str, Any],
) -> tuple[list[Any], float | None]:
    first = statement(1)
    alias, model = first.alias, first.model
    with transaction.atomic(using=alias):
        if limits.cap is not None:
            lock_bound(bounds, queue, alias)
            rows = model._base_manager.using(alias)
            running = rows.filter(queue=queue, status=Status.IN_PROGRESS).count()
            limit = min(limit, limits.cap - running)
        claimed = time.monotonic()
        items = claim(statement(limit), **options) if limit > 0 else []
        taken = len(items)
        if limits.per_key is not None and items:
            items, budgets = _within_key_budgets(
                items, queue, limits.per_key, rates_model, alias, claimed
            )
            rates.record(rates_model, budgets, alias)
    if limits.per_key is not None and not items and limit > 0:
        room = rates.seconds_to_room(rates_model, queue, alias, claimed=claimed)
        # Items given back are due: a read too late took none, though no key is spent.
        # Never "no key held back" then, or a burst run would stop with them READY.
        return items, 0.0 if room is None and taken else room
    return items, None


def _within_key_budgets(
    items: list[Any],
    queue: str,
    rate: Rate,
    rates_model: type[Model],
    alias: str,
    claimed: float,
) -> tuple[list[Any], list[rates.Budget]]:
    """The claimed ``items`` each key's budget has room for (their budgets, counted);
    the others unclaimed."""
    keys = sorted({item.key for item in items if item.key is not None})
    # The key grants' row first (key order): a grant is given under its lock.
    budgets = rates.lock_budgets(
        rates_model, queue, [rates.SHARED, *keys], rate, per_key=True, using=alias, claimed=claimed
    )
    shared = budgets.pop(rates.SHARED)
    for each in budgets.values():
        each.share(shared)
    kept: list[Any] = []
    over: list[Any] = []
    for item in items:
        budget = None if item.key is None else budgets[item.key]
        (kept if budget is None or budget.take() else over).append(item)
    if over:
        unclaim(items[0].__class__, alias, [item.pk for item in over], over[0].claim_token)
    return kept, list(budgets.values())


def queues_with_due_items(model: type[Model], alias: str, names: list[str]) -> set[str]:
    """Which of the queues ``names`` on ``alias`` have a READY item due now, in one
    statement: what a consumer looks at before claiming from queues it knows nothing of."""
    return dialect_for(alias).queues_with_due_items(model, alias, names)
