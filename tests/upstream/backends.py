"""TxQueueBackend as the upstream suites' ImmediateBackend and DummyBackend stand-ins."""

from typing import Any

from django.core.management import call_command

from django_txqueue.models import QueueItem
from django_txqueue.tasks.backend import TxQueueBackend


class QueuedBackend(TxQueueBackend):
    """TxQueueBackend itself, with the DummyBackend's ``clear()`` the tests call in setUp."""

    def clear(self) -> None:
        QueueItem.objects.all().delete()


class RunningBackend(QueuedBackend):
    """TxQueueBackend whose ``enqueue`` then runs the real consumer in burst mode and
    returns the result as ``get_result`` reads it: the ImmediateBackend's contract (a
    finished result), kept through our queue, consumer and stored result.

    The consumer serves every queue (the plugin empties them before each test).
    """

    def enqueue(self, task: Any, args: Any, kwargs: Any) -> Any:
        result = super().enqueue(task, args, kwargs)
        call_command("run_queue_consumer", burst=True, skip_checks=True, verbosity=0)
        return self.get_result(result.id)


def run_consumer(*, queue_name: str | None = None) -> None:
    """django-tasks-db's ``run_worker`` (its ``db_worker --batch``) as our consumer's
    ``--burst``: one queue, or every queue (``"*"`` or none named)."""
    queues = [] if queue_name in (None, "*") else [queue_name]
    call_command("run_queue_consumer", *queues, burst=True, skip_checks=True, verbosity=0)
