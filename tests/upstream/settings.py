"""Settings for the upstream Tasks suites: tests/settings.py's (DATABASES chosen by
TXQUEUE_TEST_DB), with the backends the plugin swaps in."""

from tests.settings import *  # noqa: F403

# django-tasks-db's suite imports its models and admin: its app is installed beside ours.
INSTALLED_APPS = [*INSTALLED_APPS, "django_tasks_db"]  # noqa: F405

# django-tasks-db's suite uses the default backend as set here (Django's classes set
# their own, which the plugin swaps).
TASKS = {
    "default": {
        "BACKEND": "tests.upstream.backends.QueuedBackend",
    }
}

# The ImmediateBackend runs a task once: a failure is final, not retried.
TXQUEUE = {**TXQUEUE, "MAX_ATTEMPTS": 1}  # noqa: F405
