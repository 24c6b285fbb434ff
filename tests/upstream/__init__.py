"""Django's and django-tasks-db's own Tasks tests, run against TxQueueBackend.

``scripts/upstream_tasks.py`` fetches their pinned source distributions at test time and
runs their tests with ``settings.py`` and the pytest plugin ``plugin.py`` of this package,
which swaps their backends for ours; their files are not copied into this repository.
"""
