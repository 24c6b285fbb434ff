"""``manage.py txqueue_chaos``: ``run`` drives a drain under faults, ``consumer`` is the
consumer process it starts, ``verify`` audits what happened.

An optional app: add ``"django_txqueue.contrib.chaos"`` to ``INSTALLED_APPS`` and run
``migrate``, which creates its one table (``ChaosRun``, the record of every handler run).
Nothing here is imported before Django is set up (the consumer process starts as
``python -m``)."""
