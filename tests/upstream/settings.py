"""Settings for the upstream Tasks suites: tests/settings.py's (DATABASES chosen by
TXQUEUE_TEST_DB), with the backends the plugin swaps in."""

from tests.settings import *  # noqa: F403

TASKS = {
    "default": {
        "BACKEND": "tests.upstream.backends.RunningBackend",
        "QUEUES": [],
    }
}

# The ImmediateBackend runs a task once: a failure is final, not retried.
TXQUEUE = {**TXQUEUE, "MAX_ATTEMPTS": 1}  # noqa: F405
