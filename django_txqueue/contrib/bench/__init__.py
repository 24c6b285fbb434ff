"""``manage.py txqueue_bench``: the queue's workloads, each beside a hand-written baseline.

An optional app: add ``"django_txqueue.contrib.bench"`` to ``INSTALLED_APPS`` to get the
command; it has no models. One module per concern: ``raw`` (the hand-written SQL queue on
a raw driver connection), ``enqueue``, ``drain``, ``wakeup``, ``scale``, ``fair`` and
``report`` (the table and the figures' arithmetic). Everything reads and writes only the
rows of one queue name (``Target.queue``), so a run never touches real items of the same
table.
"""
