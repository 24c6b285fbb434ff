"""The pytest plugin (entry point ``pytest11``): the ``txqueue`` fixture, which gives
``django_txqueue.testing``'s helpers (docs/testing.md). Imports nothing of Django's until
a test asks for it: pytest loads plugins before pytest-django sets Django up."""

from __future__ import annotations

from types import ModuleType

import pytest


@pytest.fixture
def txqueue() -> ModuleType:
    """``django_txqueue.testing``: ``txqueue.assert_enqueued("sms", {"to": "+33..."})``,
    ``txqueue.drain()``, ``txqueue.run_item(item)``. The test needs the database as any
    does (``@pytest.mark.django_db``)."""
    from django_txqueue import testing

    return testing
