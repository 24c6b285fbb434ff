"""The read behind a fair queue's rounds (``fairness``): a plain read, one index probe
per value, the same SQL on every vendor."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.db import connections

from ..status import Status
from .rows import quoted_column

if TYPE_CHECKING:
    from django.db.models import Model

# A key's waiting rounds grow with the id, but for items of producers that ran at once:
# one that read first may commit later, with a smaller round and a larger id. The
# highest round among the key's newest NEWEST waiting items is its highest round as long
# as fewer producers than that enqueue for one key at the same moment.
NEWEST = 8
# The states of an item that a claim has served.
SERVED = (Status.IN_PROGRESS, Status.DONE, Status.FAILED)


def read_rounds(model: type[Model], queue: str, key: str | None, using: str) -> tuple[int, int]:
    """The last round served in ``queue`` and the highest round of ``key``'s waiting
    items (0 for none), in one statement.

    The served round, the highest round of an item that left READY, is the maximum per
    state over an index led by (queue, state), or on MySQL by (state, queue). A key's
    newest waiting items are the last entries of the key index's (key, queue, READY)
    range, and hold the key's highest waiting round, since rounds grow with the id within
    a key (a retried item keeps its older, lower round; see ``NEWEST`` for producers
    racing).
    """
    connection = connections[using]
    table = connection.ops.quote_name(model._meta.db_table)
    round_, status, queue_column, key_column, pk = (
        quoted_column(connection, model, name)
        for name in ("round", "status", "queue", "key", "pk")
    )
    last_served = (
        f"(SELECT MAX({round_}) FROM {table} "
        f"WHERE {status} = %s AND {queue_column} = %s AND {round_} > 0)"
    )
    newest_waiting = (
        f"(SELECT MAX(newest.r) FROM (SELECT {round_} AS r FROM {table} "
        f"WHERE {key_column} = %s AND {queue_column} = %s AND {status} = %s "
        f"ORDER BY {pk} DESC LIMIT {NEWEST}) AS newest)"
    )
    params: list[Any] = []
    for state in SERVED:
        params += [int(state), queue]
    params += [key, queue, int(Status.READY)]
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT {', '.join([last_served] * len(SERVED))}, {newest_waiting}", params
        )
        *served, newest = cursor.fetchone()
    return max(int(value or 0) for value in served), int(newest or 0)
