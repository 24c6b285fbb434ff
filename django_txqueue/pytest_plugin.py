"""The pytest plugin (entry point ``pytest11``): the ``txqueue`` fixture, which gives
``django_txqueue.testing``'s helpers (docs/testing.md), and ``txqueue_inline``, the same
with handlers run at enqueue time. Imports nothing of Django's until
a test asks for it: pytest loads plugins before pytest-django sets Django up."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest


@pytest.fixture
def txqueue() -> ModuleType:
    """``django_txqueue.testing``: ``txqueue.assert_enqueued("sms", {"to": "+33..."})``,
    ``txqueue.drain()``, ``txqueue.run_item(item)``. The test needs the database as any
    does (``@pytest.mark.django_db``)."""
    from django_txqueue import testing

    return testing


@pytest.fixture
def txqueue_inline() -> Iterator[ModuleType]:
    """``txqueue``, with every enqueue of the test running its queue's items at once
    (``testing.inline()``: a test tool)."""
    from django_txqueue import testing

    with testing.inline():
        yield testing
