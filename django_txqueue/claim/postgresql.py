"""PostgreSQL: claims as single statements, and the planner's row estimate."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.db import OperationalError, connections

from ..models import Status

if TYPE_CHECKING:
    from django.db.models import QuerySet

    from . import ClaimStatement, ClaimValues

# How often an update_limit claim that lost all its rows to concurrent claims tries again.
LOST_RACE_RETRIES = 5
# serialization_failure, deadlock_detected
TRANSIENT_SQLSTATES = {"40001", "40P01"}


def claim_skip_locked(claim: ClaimStatement, values: ClaimValues) -> list[Any]:
    """Lock the first ready rows nobody else holds and claim them, in one round trip."""
    return claim.fetch(*claim_statement(claim, values, "FOR UPDATE SKIP LOCKED"))


def claim_update_limit(claim: ClaimStatement, values: ClaimValues) -> list[Any]:
    """Seed 003's reservation: claim the first n ready rows, waiting on locked ones.

    PostgreSQL has no UPDATE ... LIMIT; a locking, materialised sub-SELECT with LIMIT
    is its equivalent (unmaterialised, the planner may re-run it and claim more than
    n). A row another transaction holds is waited for and re-checked, and dropped if
    it stopped being READY meanwhile. Unlike InnoDB, PostgreSQL does not then read on
    past it, so a claim that lost every row to a concurrent one is run again while
    ready rows remain.
    """
    sql, params = claim_statement(claim, values, "FOR UPDATE")
    for _ in range(LOST_RACE_RETRIES):
        items = claim.fetch(sql, params)
        if items or not claim.queryset.exists():
            return items
    return []


def claim_statement(
    claim: ClaimStatement, values: ClaimValues, lock: str
) -> tuple[str, list[Any]]:
    """Lock the candidates with ``lock`` and claim those still READY, returning them."""
    candidates, candidate_params = claim.candidates(lock)
    assignments, assignment_params = claim.assignments(values)
    sql = (
        f"WITH picked ({claim.pk}) AS MATERIALIZED ({candidates}) "
        f"UPDATE {claim.table} SET {assignments} FROM picked "
        f"WHERE {claim.table}.{claim.pk} = picked.{claim.pk} "
        f"AND {claim.table}.{claim.column('status')} = %s "
        f"RETURNING {claim.columns()}"
    )
    return sql, candidate_params + assignment_params + [Status.READY]


def lease_expiry(now: str) -> str:
    return f"{now} + %s"


def lease_param(lease: timedelta) -> timedelta:
    return lease  # psycopg sends an interval


def is_transient(exc: OperationalError) -> bool:
    return getattr(exc.__cause__, "sqlstate", None) in TRANSIENT_SQLSTATES


def approximate_count(queryset: QuerySet[Any]) -> int:
    """The planner's row estimate for ``queryset``: statistics only, no scan."""
    connection = connections[queryset.db]
    sql, params = queryset.values("pk").query.get_compiler(connection=connection).as_sql()
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN (FORMAT JSON) {sql}", params)
        plan = cursor.fetchone()[0]
    if isinstance(plan, str):
        plan = json.loads(plan)
    return int(plan[0]["Plan"]["Plan Rows"])


# -- wake-ups ---------------------------------------------------------------------
# Producers wake consumers with NOTIFY from a statement-level trigger, so an enqueue
# stays one INSERT and PostgreSQL delivers the notification at commit (never for a
# rolled-back item). The payload is the queue name; consumers ignore other queues.

CHANNEL = "django_txqueue"
HAS_NOTIFY = True


def install_notify_trigger(schema_editor: Any, table: str) -> None:
    quoted = schema_editor.quote_name(table)
    schema_editor.execute(
        f"""
        CREATE OR REPLACE FUNCTION django_txqueue_notify() RETURNS trigger AS $$
        BEGIN
            PERFORM pg_notify('{CHANNEL}', queue) FROM (SELECT DISTINCT queue FROM inserted) q;
            RETURN NULL;
        END $$ LANGUAGE plpgsql
        """
    )
    schema_editor.execute(
        f"CREATE TRIGGER django_txqueue_notify AFTER INSERT ON {quoted} "
        "REFERENCING NEW TABLE AS inserted FOR EACH STATEMENT "
        "EXECUTE FUNCTION django_txqueue_notify()"
    )


def remove_notify_trigger(schema_editor: Any, table: str) -> None:
    quoted = schema_editor.quote_name(table)
    schema_editor.execute(f"DROP TRIGGER IF EXISTS django_txqueue_notify ON {quoted}")
    schema_editor.execute("DROP FUNCTION IF EXISTS django_txqueue_notify()")


class Listener:
    """A dedicated autocommit connection LISTENing on the queue channel.

    ``fileno()`` becomes readable when a notification arrives; ``drain()`` returns the
    queue names notified since the last call. Django's own connections are left alone.
    """

    def __init__(self, alias: str) -> None:
        import psycopg

        params = connections[alias].get_connection_params()
        params.pop("cursor_factory", None)  # Django's cursor classes need its wrapper
        params.pop("context", None)
        self.connection = psycopg.connect(**params, autocommit=True)
        self.connection.execute(f"LISTEN {CHANNEL}")

    def fileno(self) -> int:
        return int(self.connection.fileno())

    def drain(self) -> set[str]:
        pgconn = self.connection.pgconn
        pgconn.consume_input()  # raises if the server went away
        names = set()
        while (notification := pgconn.notifies()) is not None:
            names.add(notification.extra.decode())
        return names

    def close(self) -> None:
        self.connection.close()
