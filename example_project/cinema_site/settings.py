"""Settings of the cinema site: SQLite beside this project, or DATABASE_URL.

Environment variables:
- DATABASE_URL: another database, e.g. postgres://postgres@127.0.0.1:5432/cinema or
  mysql://root@127.0.0.1:3306/cinema (read by dj-database-url: pip install dj-database-url).
- CINEMA_SMS_GATEWAY_PATH: the fake SMS provider's own SQLite file (cinema/gateway.py).
- CINEMA_SMS_FAIL_RATE (0 to 1) and CINEMA_SMS_DELAY (seconds): make the fake provider
  fail that fraction of calls, and answer that slowly, to see retries and rescues.
"""

import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "example-only-not-secret")
DEBUG = os.environ.get("DJANGO_DEBUG", "1") == "1"
ALLOWED_HOSTS = ["localhost", "127.0.0.1", "[::1]"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_txqueue",
    "cinema",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "cinema_site.urls"
WSGI_APPLICATION = "cinema_site.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]


def database_settings():
    """DATABASE_URL when set, else a SQLite file beside this project."""
    url = os.environ.get("DATABASE_URL")
    if url:
        import dj_database_url

        database = dict(dj_database_url.parse(url))
    else:
        database = {"ENGINE": "django.db.backends.sqlite3", "NAME": BASE_DIR / "db.sqlite3"}
    if database["ENGINE"] == "django.db.backends.sqlite3":
        # Producers and consumers in several processes queue up for SQLite's write lock
        # instead of failing with "database is locked"; WAL lets readers run beside it.
        database["OPTIONS"] = {
            "transaction_mode": "IMMEDIATE",
            "timeout": 20,
            "init_command": "PRAGMA journal_mode=WAL;",
        }
    return database


DATABASES = {"default": database_settings()}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

USE_TZ = True
TIME_ZONE = "UTC"
LANGUAGE_CODE = "en-us"
STATIC_URL = "static/"

# Fast retries and rescues, so that the demo shows them within seconds. A real site keeps
# the defaults (retries from 10 s, a consumer dead after 60 s of silence).
TXQUEUE = {
    "RETRY_DELAY": 0.2,
    "RETRY_MAX_DELAY": 2,
    "HEARTBEAT_INTERVAL": 1,
    "CONSUMER_TIMEOUT": 4,
    "RESCUE_INTERVAL": 1,
    "POLL_INTERVAL": 1,
    "SHUTDOWN_TIMEOUT": 10,
    # With 1 call in 5 failing, ten failures in a row are a one-in-ten-million event.
    "QUEUES": {"sms": {"MAX_ATTEMPTS": 10, "LEASE": 30}},
}

# The cinema: seats are numbered 1 to CINEMA_SEATS.
CINEMA_SEATS = 100

CINEMA_SMS_GATEWAY = {
    "PATH": os.environ.get("CINEMA_SMS_GATEWAY_PATH", str(BASE_DIR / "gateway.sqlite3")),
    "FAIL_RATE": float(os.environ.get("CINEMA_SMS_FAIL_RATE", "0")),
    "DELAY": float(os.environ.get("CINEMA_SMS_DELAY", "0")),
}
