"""Peers side by side: django-txqueue beside pgqueuer, procrastinate and django-tasks-db
on the same PostgreSQL, the same drain and wake-up workloads, one table.

``python -m benchmarks.peers`` (or ``tox -e peers``). One module per queue system; each
offers ``prepare()``, ``drain(items, processes)`` and ``wakeup(samples)``.
"""
