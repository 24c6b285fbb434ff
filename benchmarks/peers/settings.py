"""Django settings for the peers benchmark: our queue and django-tasks-db in one database
of the benchmark's own (dropped and created again by each run)."""

import os

SECRET_KEY = "peers-benchmark-only"  # noqa: S105
USE_TZ = True
TIME_ZONE = "UTC"
INSTALLED_APPS = ["django.contrib.contenttypes", "django_txqueue", "django_tasks_db"]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ.get("PEERS_DB_NAME", "txqueue_peers"),
        "USER": os.environ.get("PEERS_DB_USER", "postgres"),
        "HOST": os.environ.get("PEERS_DB_HOST", "127.0.0.1"),
        "PORT": os.environ.get("PEERS_DB_PORT", "5432"),
    }
}
TASKS = {"default": {"BACKEND": "django_tasks_db.DatabaseBackend"}}
