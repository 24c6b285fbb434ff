"""Django's Tasks framework on the queue: ``backend.TxQueueBackend``, which settings name by
its public path ``django_txqueue.backends.TxQueueBackend``."""
