"""A subclass of the package's Tasks backend, which task_handlers() must find too
(tests/test_backends.py names it in TASKS)."""

from django_txqueue.tasks.backend import TxQueueBackend


class MyBackend(TxQueueBackend):
    pass
