"""pytest plugin swapping the upstream Tasks suites' backends for ours (tests.upstream).

Each test class's ``override_settings(TASKS=...)`` names Django's DummyBackend or
ImmediateBackend, or django-tasks-db's DatabaseBackend; here each becomes TxQueueBackend:
the DummyBackend (tasks stay READY) as ``QueuedBackend``, the ImmediateBackend (tasks
have run when enqueue returns) as ``RunningBackend``. django-tasks-db's DatabaseBackend
becomes ``QueuedBackend`` where its module names it, and its ``run_worker`` (its worker
command) our consumer's burst. Tests that cannot apply to a queue backend
are deselected, each with its reason in ``DESELECTED``.
"""

import sys
from typing import Any

import pytest

SWAPS = {
    "django.tasks.backends.dummy.DummyBackend": "tests.upstream.backends.QueuedBackend",
    "django.tasks.backends.immediate.ImmediateBackend": "tests.upstream.backends.RunningBackend",
}

# Test (a node id's end) -> why it cannot apply to TxQueueBackend.
DUMMY_RESULTS = "reads the DummyBackend's in-memory results list, which a queue has not"
SYNC_IN_ASYNC = (
    "calls the backend synchronously from an async test: a database backend's sync calls "
    "refuse an event loop (SynchronousOnlyOperation); their async forms run elsewhere"
)
TASKS_DB_OWN = "tests django-tasks-db's own {}, not the backend contract"
ROWS = "reads or writes django-tasks-db's DBTaskResult rows, which our backend never uses"
QUERIES = "counts django-tasks-db's queries (assertNumQueries); ours differ in number"
UUIDS = "expects django-tasks-db's UUID ids (its id_function option); ours are the item's id"
WORKER = TASKS_DB_OWN.format("db_worker options (intervals, max_tasks, verbosity, queues)")
MODEL = TASKS_DB_OWN.format("DBTaskResult model")
DB = "test_django_tasks_db.py::"
BACKEND, WORKER_CASE = f"{DB}DatabaseBackendTestCase::", f"{DB}DatabaseBackendWorkerTestCase::"
DESELECTED: dict[str, str] = {
    "::DatabaseTaskResultTestCase": TASKS_DB_OWN.format("model (DBTaskResult row locks)"),
    "::ConnectionExclusiveTranscationTestCase": TASKS_DB_OWN.format("SQLite transaction helper"),
    "::DatabaseBackendPruneTaskResultsTestCase": TASKS_DB_OWN.format("prune command"),
    "::DatabaseWorkerProcessTestCase": TASKS_DB_OWN.format("db_worker process and signals"),
    "::DBTaskResultOrderingTestCase": TASKS_DB_OWN.format("model's ordering"),
    "::AdminTestCase": TASKS_DB_OWN.format("admin"),
    "::CompatTestCase": TASKS_DB_OWN.format("compat module"),
    f"{BACKEND}test_enqueue_task": QUERIES,
    f"{BACKEND}test_enqueue_task_async": UUIDS,
    f"{BACKEND}test_get_result": QUERIES,
    f"{BACKEND}test_custom_id_function": UUIDS,
    f"{BACKEND}test_unknown_id_function": UUIDS,
    f"{BACKEND}test_postgres_db_id_function": UUIDS,
    f"{BACKEND}test_postgres_id_function_expression": UUIDS,
    f"{BACKEND}test_database_backend_app_missing": "expects its check's hint to name its app",
    f"{BACKEND}test_doesnt_wait_until_transaction_commit": ROWS,
    f"{BACKEND}test_index_scan_for_ready": ROWS,
    f"{BACKEND}test_refresh_result": ROWS,
    f"{BACKEND}test_refresh_result_async": ROWS,
    f"{BACKEND}test_run_after_null_0016_migration": ROWS,
    f"{BACKEND}test_run_after_tz": ROWS,
    f"{BACKEND}test_invalid_task_path": MODEL,
    f"{BACKEND}test_missing_task_path": MODEL,
    f"{BACKEND}test_task_name": MODEL,
    f"{BACKEND}test_priority_range_check": MODEL,
    f"{WORKER_CASE}test_run_enqueued_task": ROWS,
    f"{WORKER_CASE}test_batch_processes_all_tasks": ROWS,
    f"{WORKER_CASE}test_no_tasks": QUERIES,
    f"{WORKER_CASE}test_doesnt_process_different_queue": ROWS,
    f"{WORKER_CASE}test_process_all_queues": ROWS,
    f"{WORKER_CASE}test_process_all_queues_excluding_one_queue": ROWS,
    f"{WORKER_CASE}test_exclude_queues_requires_processing_all_queues": ROWS,
    f"{WORKER_CASE}test_excluding_unknown_queue_processes_selected_queues": ROWS,
    f"{WORKER_CASE}test_failing_task": ROWS,
    f"{WORKER_CASE}test_complex_exception": ROWS,
    f"{WORKER_CASE}test_doesnt_process_different_backend": ROWS,
    f"{WORKER_CASE}test_run_after": ROWS,
    f"{WORKER_CASE}test_run_after_priority": ROWS,
    f"{WORKER_CASE}test_invalid_task_path": ROWS,
    f"{WORKER_CASE}test_missing_task_path": ROWS,
    f"{WORKER_CASE}test_task_import_string": ROWS,
    f"{WORKER_CASE}test_worker_with_locked_rows": ROWS,
    f"{WORKER_CASE}test_unknown_backend": WORKER,
    f"{WORKER_CASE}test_incorrect_backend": WORKER,
    f"{WORKER_CASE}test_negative_interval": WORKER,
    f"{WORKER_CASE}test_infinite_interval": WORKER,
    f"{WORKER_CASE}test_fractional_interval": WORKER,
    f"{WORKER_CASE}test_zero_interval": WORKER,
    f"{WORKER_CASE}test_negative_max_tasks": WORKER,
    f"{WORKER_CASE}test_zero_max_tasks": WORKER,
    f"{WORKER_CASE}test_too_long_worker_id": WORKER,
    f"{WORKER_CASE}test_empty_worker_id": WORKER,
    f"{WORKER_CASE}test_max_tasks": WORKER,
    f"{WORKER_CASE}test_verbose_logging": WORKER,
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


def pytest_sessionstart(session: pytest.Session) -> None:
    """django-tasks-db's suite enqueues ``tests.tasks``, not in its sdist: those are
    Django's ``tests/tasks/tasks.py`` (the same tasks), lent under that name."""
    import tasks.tasks

    import tests

    sys.modules["tests.tasks"] = tests.tasks = tasks.tasks  # type: ignore[attr-defined]

    # Its tests name "django_tasks_db.DatabaseBackend" in class and method decorators and
    # in with blocks: the path itself leads to ours.
    import django_tasks_db

    from .backends import QueuedBackend

    django_tasks_db.DatabaseBackend = QueuedBackend


def chosen(nodeid: str, end: str) -> bool:
    """Whether ``end`` names this test (the end of its node id) or its class."""
    return nodeid.endswith(end) or f"{end}::" in nodeid


def swapped(tasks: dict[str, Any]) -> dict[str, Any]:
    return {
        alias: {**params, "BACKEND": SWAPS.get(params.get("BACKEND"), params.get("BACKEND"))}
        for alias, params in tasks.items()
    }


@pytest.hookimpl(tryfirst=True)  # before -k or -m: every entry must still name a test
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    kept, dropped, used = [], [], set()
    for item in items:
        end = next((end for end in DESELECTED if chosen(item.nodeid, end)), None)
        (kept if end is None else dropped).append(item)
        used.add(end)
        cls = getattr(item, "cls", None)
        overridden = getattr(cls, "_overridden_settings", None) or {}
        if "TASKS" in overridden and not getattr(cls, "_txqueue_swapped", False):
            cls._overridden_settings = {**overridden, "TASKS": swapped(overridden["TASKS"])}
            cls._txqueue_swapped = True
        if cls is not None and "run_worker" in vars(cls):
            from .backends import run_consumer

            cls.run_worker = staticmethod(run_consumer)
        if cls is not None and not getattr(cls, "databases", None):
            cls.databases = {"default"}  # their SimpleTestCases: our backend stores rows
    stale = sorted(set(DESELECTED) - used)
    if stale and len(config.args) == 2:  # both suites whole: an upstream release renamed them
        raise pytest.UsageError(f"tests/upstream/plugin.py leaves out no such tests: {stale}")
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
