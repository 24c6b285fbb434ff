"""The consumers' identities (``host:os-pid:random``) and their ``Consumer`` rows:
register, heartbeat, stop, delete.
"""

from __future__ import annotations

import os
import secrets
import socket
from typing import TYPE_CHECKING, Any, ClassVar

from django.db.models.functions import Now

from .conflicts import delete_retrying, retrying_conflicts, update_retrying

if TYPE_CHECKING:
    from django.db.models import QuerySet

    from ..models import Consumer


def new_identity() -> str:
    """A consumer identity, ``host:os-pid:random``, never issued before.

    The random part makes a restarted container (same host name, same pid 1) a new
    consumer, so its predecessor's items are recognisably orphaned.
    """
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


class ConsumerIdentity:
    """This process's default identity for claims, new after a fork."""

    _value: ClassVar[str | None] = None

    @classmethod
    def get(cls) -> str:
        if cls._value is None:
            cls._value = new_identity()
        return cls._value

    @classmethod
    def reset(cls) -> None:
        cls._value = None


os.register_at_fork(after_in_child=ConsumerIdentity.reset)


def consumer_identity() -> str:
    """The default ``pid`` that claims by this process write on items."""
    return ConsumerIdentity.get()


def register(consumer: Consumer, using: str) -> Consumer:
    """Insert the Consumer row of a starting consumer."""
    retrying_conflicts(lambda: consumer.save(force_insert=True, using=using), using)
    return consumer


def beat(consumer: Consumer, *, processed: int, failed: int, queues: list[str]) -> None:
    """Heartbeat: the consumer is alive (database clock), with its counters and the queues
    it serves now (it may find new ones)."""
    update_retrying(
        _consumer_row(consumer),
        last_heartbeat_at=Now(),
        processed=processed,
        failed=failed,
        queues=queues,
    )


def stop(consumer: Consumer, *, processed: int, failed: int) -> None:
    """Mark the consumer stopped: its unfinished items are stuck from now on."""
    update_retrying(_consumer_row(consumer), stopped_at=Now(), processed=processed, failed=failed)


def delete_consumers(consumers: QuerySet[Any]) -> int:
    """Delete the rows of ``consumers``, stopped ones a tool ran for a while and that
    nobody needs to tell from live ones afterwards; returns how many."""
    return delete_retrying(consumers.order_by())


def _consumer_row(consumer: Consumer) -> QuerySet[Any]:
    return type(consumer)._default_manager.using(consumer._state.db).filter(pk=consumer.pk)
