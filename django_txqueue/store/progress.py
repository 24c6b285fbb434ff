"""Progress reports of running items (``QueueItem.report_progress``): one row per item in
a table of their own, written fenced by the claim that reports."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.db.models import Exists, OuterRef
from django.db.models.functions import Now

from ..db import dialect_for
from ..status import Status
from .conflicts import delete_retrying, retrying_conflicts, update_retrying

if TYPE_CHECKING:
    from django.db.models import Model

    from ..models import QueueItem


def report_progress(item: QueueItem, reports: type[Model], report: dict[str, Any]) -> bool:
    """Write ``report`` as ``item``'s progress if its claim still holds it: one UPDATE
    once its row exists, a check and an upsert the first time; False if not held."""
    alias = item._state.db or "default"
    if item.claim_token is None:
        return False
    held = (
        type(item)
        ._base_manager.using(alias)
        .filter(pk=item.pk, status=Status.IN_PROGRESS, claim_token=item.claim_token)
    )
    rows = reports._default_manager.using(alias)
    mine = rows.filter(pk=item.pk).filter(Exists(held))
    if update_retrying(mine, claim_token=item.claim_token, report=report, reported_at=Now()):
        return True
    if not held.exists():
        return False
    # Another run of the item may create it meanwhile: the upsert writes this one's, which
    # reads as none once that run reports (``read_progress`` compares the claims).
    row = reports(item_id=item.pk, claim_token=item.claim_token, report=report)
    retrying_conflicts(
        lambda: rows.bulk_create(
            [row],
            update_conflicts=True,
            unique_fields=dialect_for(alias).upsert_target(["item"]),
            update_fields=["claim_token", "report", "reported_at"],
        ),
        alias,
    )
    return True


def read_progress(item: QueueItem, reports: type[Model]) -> dict[str, Any] | None:
    """``item``'s last progress report, or None: none yet, or an earlier run's while it
    runs again."""
    alias = item._state.db or "default"
    row = (
        reports._default_manager.using(alias)
        .filter(pk=item.pk)
        .values_list("claim_token", "report")
        .first()
    )
    if row is None or (item.status == Status.IN_PROGRESS and row[0] != item.claim_token):
        return None
    return row[1]  # type: ignore[no-any-return]


def running_reports(items: Any, reports: type[Model]) -> Any:
    """``items`` annotated with ``progress_report``: the report of their current claim's
    run, or None (a subquery; for the admin's and the dashboard's lists)."""
    current = reports._default_manager.filter(
        pk=OuterRef("pk"), claim_token=OuterRef("claim_token")
    )
    return items.annotate(progress_report=current.values("report")[:1])


def forget_reports(items: type[Model], reports: type[Model], alias: str) -> int:
    """Delete the reports of items that are gone (purged or deleted); how many. A read
    first, so that a purge where no item reported writes nothing more."""
    rows = reports._default_manager.using(alias)
    gone = rows.exclude(Exists(items._base_manager.using(alias).filter(pk=OuterRef("pk"))))
    return delete_retrying(gone) if gone.exists() else 0
