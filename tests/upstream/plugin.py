"""pytest plugin swapping the upstream Tasks suites' backends for ours (tests.upstream).

Each test class's ``override_settings(TASKS=...)`` names Django's DummyBackend or
ImmediateBackend, or django-tasks-db's DatabaseBackend; here each becomes TxQueueBackend:
the DummyBackend (tasks stay READY) as ``QueuedBackend``, the others (tasks have run
when enqueue returns) as ``RunningBackend``. Tests that cannot apply to a queue backend
are deselected, each with its reason in ``DESELECTED``.
"""

from typing import Any

import pytest

SWAPS = {
    "django.tasks.backends.dummy.DummyBackend": "tests.upstream.backends.QueuedBackend",
    "django.tasks.backends.immediate.ImmediateBackend": "tests.upstream.backends.RunningBackend",
    "django_tasks_db.DatabaseBackend": "tests.upstream.backends.RunningBackend",
}

# Test (a node id's end) -> why it cannot apply to TxQueueBackend.
DUMMY_RESULTS = "reads the DummyBackend's in-memory results list, which a queue has not"
SYNC_IN_ASYNC = (
    "calls the backend synchronously from an async test: a database backend's sync calls "
    "refuse an event loop (SynchronousOnlyOperation); their async forms run elsewhere"
)
DESELECTED: dict[str, str] = {
    "::test_using_correct_backend": "asserts the class is Django's own backend",
    "test_tasks.py::TaskTestCase::test_get_backend": "asserts the class is Django's own backend",
    "test_dummy_backend.py::DummyBackendTestCase::test_enqueue_task": DUMMY_RESULTS,
    "test_dummy_backend.py::DummyBackendTestCase::test_enqueue_task_async": DUMMY_RESULTS,
    "test_dummy_backend.py::DummyBackendTestCase::test_refresh_result": DUMMY_RESULTS,
    "test_dummy_backend.py::DummyBackendTestCase::test_refresh_result_async": DUMMY_RESULTS,
    "test_tasks.py::TaskTestCase::test_enqueue_task": DUMMY_RESULTS,
    "test_tasks.py::TaskTestCase::test_enqueue_task_async": DUMMY_RESULTS,
    "test_dummy_backend.py::DummyBackendTestCase::test_get_missing_result": SYNC_IN_ASYNC,
    "test_tasks.py::TaskTestCase::test_get_missing_result": SYNC_IN_ASYNC,
    "test_tasks.py::TaskTestCase::test_refresh_result": SYNC_IN_ASYNC,
    "test_immediate_backend.py::ImmediateBackendTestCase::test_throws_keyboard_interrupt": (
        "expects KeyboardInterrupt to escape; a consumer records a task's KeyboardInterrupt "
        "as its failure (the item's, not the consumer's), as for SystemExit"
    ),
    "test_immediate_backend.py::ImmediateBackendTestCase::test_cannot_get_result": (
        "expects NotImplementedError from get_result; TxQueueBackend supports get_result"
    ),
    "test_immediate_backend.py::ImmediateBackendTestCase::test_cannot_refresh_result": (
        "expects NotImplementedError from refresh; TxQueueBackend supports get_result"
    ),
    "test_immediate_backend.py::ImmediateBackendTestCase::test_cannot_pass_run_after": (
        "expects run_after refused; TxQueueBackend supports run_after (supports_defer)"
    ),
}


def swapped(tasks: dict[str, Any]) -> dict[str, Any]:
    return {
        alias: {**params, "BACKEND": SWAPS.get(params.get("BACKEND"), params.get("BACKEND"))}
        for alias, params in tasks.items()
    }


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    kept, dropped = [], []
    for item in items:
        reason = next((why for end, why in DESELECTED.items() if item.nodeid.endswith(end)), None)
        (dropped if reason else kept).append(item)
        cls = getattr(item, "cls", None)
        overridden = getattr(cls, "_overridden_settings", None) or {}
        if "TASKS" in overridden and not getattr(cls, "_txqueue_swapped", False):
            cls._overridden_settings = {**overridden, "TASKS": swapped(overridden["TASKS"])}
            cls._txqueue_swapped = True
        if cls is not None and not getattr(cls, "databases", None):
            cls.databases = {"default"}  # their SimpleTestCases: our backend stores rows
    items[:] = kept
    config.hook.pytest_deselected(items=dropped)


@pytest.fixture(autouse=True)
def _queue_database(request: pytest.FixtureRequest) -> Any:
    """The test database, open to every upstream test, emptied of items before each."""
    request.getfixturevalue("django_db_setup")
    with request.getfixturevalue("django_db_blocker").unblock():
        from django_txqueue.models import QueueItem

        QueueItem.objects.all().delete()
        yield
