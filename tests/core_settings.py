"""The test settings without the queue's optional apps: a project with ``django_txqueue``
alone in ``INSTALLED_APPS`` (tests/test_migrations.py, tests/contrib/test_apps.py)."""

from .settings import *  # noqa: F403
from .settings import INSTALLED_APPS

INSTALLED_APPS = [app for app in INSTALLED_APPS if not app.startswith("django_txqueue.contrib")]
