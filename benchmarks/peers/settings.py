"""Django settings for the peers benchmark: our queue and django-tasks-db in one database
of the benchmark's own (dropped and created again by each run).

The peers' own psycopg connections prepare a statement run five times (psycopg's default
``prepare_threshold``); Django's connections prepare none unless ``OPTIONS`` say so. So
that each system runs with the same driver setting, Django's connection here prepares as
psycopg's default does; ``PEERS_PREPARE_THRESHOLD=none`` runs Django's default instead."""

import os

SECRET_KEY = "peers-benchmark-only"  # noqa: S105
USE_TZ = True
TIME_ZONE = "UTC"
INSTALLED_APPS = ["django.contrib.contenttypes", "django_txqueue", "django_tasks_db"]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
_threshold = os.environ.get("PEERS_PREPARE_THRESHOLD", "5")
PREPARE_THRESHOLD = None if _threshold.lower() == "none" else int(_threshold)
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ.get("PEERS_DB_NAME", "txqueue_peers"),
        "USER": os.environ.get("PEERS_DB_USER", "postgres"),
        "HOST": os.environ.get("PEERS_DB_HOST", "127.0.0.1"),
        "PORT": os.environ.get("PEERS_DB_PORT", "5432"),
        "OPTIONS": {"prepare_threshold": PREPARE_THRESHOLD},
    }
}
TASKS = {"default": {"BACKEND": "django_tasks_db.DatabaseBackend"}}
