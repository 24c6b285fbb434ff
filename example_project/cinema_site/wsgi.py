"""WSGI entry point: ``gunicorn --chdir example_project cinema_site.wsgi``."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "cinema_site.settings")

application = get_wsgi_application()
