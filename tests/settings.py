"""Test settings: one suite, the database picked by TXQUEUE_TEST_DB.

TXQUEUE_TEST_DB=sqlite (default) | postgresql | mysql. Host and port can be moved with
TXQUEUE_TEST_HOST / TXQUEUE_TEST_PORT. Child processes started by the concurrency
tests pass TXQUEUE_TEST_NAME so they open the test database, not the real one.
"""

import json
import os
import tempfile
from typing import Any

SECRET_KEY = "tests-only"  # noqa: S105
USE_TZ = True
TIME_ZONE = "UTC"
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django_txqueue",
    # The optional apps, so that their commands and table are tested too.
    "django_txqueue.contrib.bench",
    "django_txqueue.contrib.chaos",
    "tests.testapp",
]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
# The admin, for tests/test_admin.py; a fast hasher for its users.
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
ROOT_URLCONF = "tests.urls"
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

VENDOR = os.environ.get("TXQUEUE_TEST_DB", "sqlite")
HOST = os.environ.get("TXQUEUE_TEST_HOST", "127.0.0.1")
_name = os.environ.get("TXQUEUE_TEST_NAME")
# Separate test databases for test runs that share a machine at the same time.
_run = os.environ.get("TXQUEUE_TEST_RUN", "")
_test_name = f"test_txqueue{_run}"

if VENDOR == "sqlite":
    # A file, not :memory:, so that several processes share one database.
    _file = os.path.join(tempfile.gettempdir(), f"{_test_name}-{os.getuid()}.sqlite3")
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": _name or _file,
            "TEST": {"NAME": _file},
            "OPTIONS": {
                "transaction_mode": "IMMEDIATE",
                "timeout": 30,
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
            },
        }
    }
elif VENDOR == "postgresql":
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": _name or "test",
            "USER": os.environ.get("TXQUEUE_TEST_USER", "postgres"),
            "TEST": {"NAME": _test_name},
            "HOST": HOST,
            "PORT": os.environ.get("TXQUEUE_TEST_PORT", "5432"),
        }
    }
elif VENDOR == "mysql":
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.mysql",
            "NAME": _name or "test",
            "USER": os.environ.get("TXQUEUE_TEST_USER", "root"),
            "TEST": {"NAME": _test_name},
            "HOST": HOST,
            "PORT": os.environ.get("TXQUEUE_TEST_PORT", "3306"),
            "OPTIONS": {"charset": "utf8mb4"},
        }
    }
else:
    raise RuntimeError(f"TXQUEUE_TEST_DB must be sqlite, postgresql or mysql, not {VENDOR!r}")


def _second(vendor: str) -> dict[str, Any]:
    """A second database for queues placed elsewhere (tests/test_databases.py): on the
    same server by default, on another vendor's (TXQUEUE_TEST_OTHER_DB), or on another
    server (TXQUEUE_TEST_OTHER_PORT)."""
    name, test_name = os.environ.get("TXQUEUE_TEST_OTHER_NAME"), f"{_test_name}_other"
    if vendor == "sqlite":
        file = os.path.join(tempfile.gettempdir(), f"{test_name}-{os.getuid()}.sqlite3")
        return {**DATABASES["default"], "NAME": name or file, "TEST": {"NAME": file}}
    engine, port, user = {
        "postgresql": ("postgresql", "5432", "postgres"),
        "mysql": ("mysql", "3306", "root"),
    }[vendor]
    if vendor == VENDOR:  # the default's server, and in a child told nothing of it, its
        # database: Django's checks connect to every alias
        port, user = str(DATABASES["default"]["PORT"]), str(DATABASES["default"]["USER"])
        name = name or str(DATABASES["default"]["NAME"])
    # tests/e2e/test_two_servers.py moves it to a throwaway server of its own.
    return {
        "ENGINE": f"django.db.backends.{engine}",
        "NAME": name or "test",
        "USER": os.environ.get("TXQUEUE_TEST_OTHER_USER", user),
        "HOST": HOST,
        "PORT": os.environ.get("TXQUEUE_TEST_OTHER_PORT", port),
        "TEST": {"NAME": test_name},
        **({"OPTIONS": {"charset": "utf8mb4"}} if vendor == "mysql" else {}),
    }


OTHER_VENDOR = os.environ.get("TXQUEUE_TEST_OTHER_DB", VENDOR)
DATABASES["other"] = _second(OTHER_VENDOR)

TXQUEUE = {
    "QUEUES": {
        "bounded": {"MAX_SIZE": 3},
        "short": {"LEASE": 1, "MAX_ATTEMPTS": 2},
        # tests/test_fairness.py
        "fair": {"FAIR": True},
        "ordered": {"ORDERED": True},
        "fair-ordered": {"FAIR": True, "ORDERED": True},
        "limited": {"MAX_IN_FLIGHT_PER_KEY": 2},
    }
}
# Those queues are claimed by hand in their tests, served by no handler: a consumer process's
# system checks would print txqueue.W004 for each, in the stderr its tests read line by line.
# tests/test_checks.py's TestQueuesWithoutHandler unsilences it.
SILENCED_SYSTEM_CHECKS = ["txqueue.W004"]
# Consumer processes started by the tests get faster heartbeats and rescues this way.
TXQUEUE.update(json.loads(os.environ.get("TXQUEUE_TEST_SETTINGS", "{}")))

# Django Tasks (django.tasks on Django 6+, the django-tasks backport on 5.2) through the
# queue: tests/test_backends.py. Without either framework the setting is ignored.
TASKS = {
    "default": {
        "BACKEND": "django_txqueue.backends.TxQueueBackend",
        "QUEUES": ["default", "tasks-other"],
    }
}
