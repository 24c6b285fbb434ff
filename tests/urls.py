"""The admin, for tests/test_admin.py; the package's own views (tests/test_health.py,
tests/test_metrics.py)."""

from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("txqueue/", include("django_txqueue.urls")),
]
