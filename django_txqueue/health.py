"""The health probes' old import path: they live in ``django_txqueue.observe.health``
(``health_view`` for a URLconf, ``run`` for a script), re-exported here."""

from .observe.health import health_view, run

__all__ = ["health_view", "run"]
