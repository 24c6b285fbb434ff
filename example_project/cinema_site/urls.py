from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("txqueue/", include("django_txqueue.urls")),  # txqueue/metrics: docs/metrics.md
    path("", include("cinema.urls")),
]
