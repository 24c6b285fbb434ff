"""The smallest Django project that lets autodoc import django_txqueue and each management
command build its parser: the queue app, its optional apps, an in-memory SQLite database."""

SECRET_KEY = "docs-only"  # noqa: S105 (never served)
USE_TZ = True
TIME_ZONE = "UTC"
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django_txqueue",
    "django_txqueue.contrib.bench",
    "django_txqueue.contrib.chaos",
]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
