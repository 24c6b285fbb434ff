"""The package's own views, included by a project with
``path("txqueue/", include("django_txqueue.urls"))``.

``metrics``: the database-side Prometheus gauges (``collector.py``), for a staff user
with the queue items' view permission, or for a scraper sending
``Authorization: Bearer <TXQUEUE["METRICS_TOKEN"]>``. The consumers' own counters are
served by ``run_queue_consumer --metrics-port``: a web process runs no handlers.
"""

from __future__ import annotations

import hmac

from django.http import HttpRequest, HttpResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from .. import conf
from .metrics import EXTRA_HINT, MetricsUnavailable, prometheus

VIEW_PERMISSION = "django_txqueue.view_queueitem"


def bearer_token(request: HttpRequest) -> str | None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def token_allows(request: HttpRequest) -> bool:
    expected = conf.get("METRICS_TOKEN")
    given = bearer_token(request)
    if not expected or given is None:
        return False
    return hmac.compare_digest(given.encode(), str(expected).encode())


def staff_allows(request: HttpRequest) -> bool:
    user = getattr(request, "user", None)  # None: no AuthenticationMiddleware
    return bool(
        user is not None and user.is_active and user.is_staff and user.has_perm(VIEW_PERMISSION)
    )


@require_GET
@never_cache
def metrics(request: HttpRequest) -> HttpResponse:
    if not (token_allows(request) or staff_allows(request)):
        user = getattr(request, "user", None)
        if user is not None and user.is_authenticated and bearer_token(request) is None:
            return HttpResponse("Forbidden.\n", status=403, content_type="text/plain")
        denied = HttpResponse("Unauthorized.\n", status=401, content_type="text/plain")
        denied["WWW-Authenticate"] = 'Bearer realm="txqueue metrics"'
        return denied
    try:
        client = prometheus()
    except MetricsUnavailable:
        return HttpResponse(
            f"Metrics need prometheus-client: {EXTRA_HINT}\n",
            status=501,
            content_type="text/plain",
        )
    from .collector import QueueCollector

    registry = client.CollectorRegistry(auto_describe=False)
    registry.register(QueueCollector())
    return HttpResponse(client.generate_latest(registry), content_type=client.CONTENT_TYPE_LATEST)
