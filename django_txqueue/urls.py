"""The package's URLs: ``path("txqueue/", include("django_txqueue.urls"))`` in a project's
URLconf serves ``txqueue/metrics`` (docs/metrics.md)."""

from django.urls import path

from . import views

app_name = "django_txqueue"
urlpatterns = [
    path("metrics", views.metrics, name="metrics"),
]
