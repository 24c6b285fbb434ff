"""The package's own views, for a project to ``path("txqueue/", include("django_txqueue.urls"))``:
``health/``, the JSON health probe (``observe/health.py``, docs/health.md), and ``metrics``, the
Prometheus gauges read from the database (``observe/views.py``, docs/metrics.md)."""

from django.urls import path

from .observe import health, views

app_name = "django_txqueue"

urlpatterns = [
    path("health/", health.health_view, name="health"),
    path("metrics", views.metrics, name="metrics"),
]
