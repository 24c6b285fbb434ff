"""The package's own views, for a project to ``include("django_txqueue.urls")``:
``health/``, the JSON health probe (``health.py``)."""

from django.urls import path

from . import health

app_name = "django_txqueue"

urlpatterns = [
    path("health/", health.health_view, name="health"),
]
