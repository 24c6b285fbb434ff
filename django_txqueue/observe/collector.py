"""The database-side Prometheus gauges, read at scrape time (the ``prometheus`` extra).

``QueueCollector`` follows prometheus_client's Collector protocol: each ``collect()``
reads the queues through ``reads.gauges`` (the dashboard's grouped queries, then
per queue its DONE items: counted while the table is small, else the planner's estimate)
for the queues with unfinished items and those known by name
(``reads.known_queue_names``), on every database that holds queues, and yields
gauges labelled by queue (and status): never an item id. Nothing here is imported
unless metrics are asked for.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from django.db import DatabaseError, connections

from ..api import queue_databases
from ..models import Consumer, QueueItem
from .metrics import prometheus
from .reads import QueueRow, gauges, known_queue_names

logger = logging.getLogger(__name__)

# The statuses ``txqueue_items`` reports, as label values.
STATUSES = ("ready", "in_progress", "waiting", "failed", "cancelled", "done")


def queue_rows(aliases: list[str]) -> dict[str, QueueRow]:
    """``reads.gauges`` on each alias, a queue's figures added up where several
    databases hold it (its oldest due item: the oldest of them)."""
    merged: dict[str, QueueRow] = {}
    for alias in aliases:
        items, consumers = QueueItem.objects.using(alias), Consumer.objects.using(alias)
        for row in gauges(items, consumers, known_queue_names(items, consumers)):
            total = merged.setdefault(row.name, QueueRow(row.name))
            for status in (*STATUSES, "consumers", "held_back"):
                setattr(total, status, getattr(total, status) + getattr(row, status))
            total.paused = total.paused or row.paused
            if row.oldest_ready is not None and (
                total.oldest_ready is None or row.oldest_ready > total.oldest_ready
            ):
                total.oldest_ready = row.oldest_ready
    return merged


class QueueCollector:
    """Per queue: ``txqueue_items{queue,status}``, ``txqueue_oldest_ready_age_seconds``,
    ``txqueue_live_consumers``, ``txqueue_paused`` and ``txqueue_rate_limited_items``.

    ``close_connections``: close this thread's database connections after each read, for
    an HTTP server thread that Django's request cycle does not clean up after.
    """

    def __init__(self, aliases: list[str] | None = None, *, close_connections: bool = False):
        self.aliases = aliases
        self.close_connections = close_connections

    def describe(self) -> list[Any]:
        return []  # no query when registered: the families are known only by reading

    def collect(self) -> Iterator[Any]:
        prometheus()  # MetricsUnavailable without the extra
        from prometheus_client.core import GaugeMetricFamily as family

        try:
            rows = queue_rows(self.aliases or queue_databases())
        except DatabaseError as exc:
            # The consumers' own counters still make the scrape; these gauges go missing,
            # which alerting on absent() or on the scrape's own errors sees.
            logger.warning("metrics: could not read the queues: %s", exc)
            return
        finally:
            if self.close_connections:
                connections.close_all()
        items = family("txqueue_items", "Items per queue and status.", labels=["queue", "status"])
        oldest = family(
            "txqueue_oldest_ready_age_seconds",
            "How long the queue's oldest due READY item has waited (0: none waiting).",
            labels=["queue"],
        )
        live = family(
            "txqueue_live_consumers", "Live consumers serving the queue.", labels=["queue"]
        )
        paused = family("txqueue_paused", "1 while the queue is paused.", labels=["queue"])
        held = family(
            "txqueue_rate_limited_items",
            "Due READY items held back by a spent rate budget (the queue's or their key's).",
            labels=["queue"],
        )
        for name, row in sorted(rows.items()):
            for status in STATUSES:
                items.add_metric([name, status], getattr(row, status))
            age = row.oldest_ready.total_seconds() if row.oldest_ready is not None else 0.0
            oldest.add_metric([name], age)
            live.add_metric([name], row.consumers)
            paused.add_metric([name], 1 if row.paused else 0)
            held.add_metric([name], row.held_back)
        yield from (items, oldest, live, paused, held)
