"""The ``TASKS`` path users write, ``django_txqueue.backends.TxQueueBackend``: the Django
Tasks backend itself lives in ``django_txqueue.tasks.backend``."""

from .tasks.backend import TxQueueBackend

__all__ = ["TxQueueBackend"]
