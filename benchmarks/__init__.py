"""The repository's benchmarks, run by hand or by tox, outside the package and outside
pytest's reach (docs/benchmarks.md).

- ``python -m benchmarks.peers``: django-txqueue beside pgqueuer, procrastinate and
  django-tasks-db on one PostgreSQL.
- ``python -m benchmarks.admin``, ``.cpu``, ``.rss``, ``.soak``, ``.xmin``: the admin at a
  million rows, CPU per item, a consumer's memory, a long steady load, and claims under
  an old snapshot; each on a database of its own (``database.prepare_database``), with
  the test settings (``DJANGO_SETTINGS_MODULE=tests.settings``).

The queue's own workloads beside a hand-written baseline are a command users run on
their database, shipped in the optional app ``django_txqueue.contrib.bench``
(``manage.py txqueue_bench``).
"""
