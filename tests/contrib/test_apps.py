"""The tools are optional apps: their commands exist once they are in ``INSTALLED_APPS``,
and a project without them gets Django's "Unknown command"."""

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

COMMANDS = ["txqueue_bench", "txqueue_chaos"]


def django_admin(settings, *args):
    """``python -m django ARGS`` with ``settings``, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "django", *args],
        env={**os.environ, "DJANGO_SETTINGS_MODULE": settings, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("command", COMMANDS)
def test_the_command_runs_with_its_app_installed(command):
    done = django_admin("tests.settings", command, "--help")
    assert done.returncode == 0, done.stderr
    assert f"usage: __main__.py {command}" in done.stdout
    assert "--json" in done.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_without_its_app_the_command_is_unknown(command):
    done = django_admin("tests.core_settings", command, "--help")
    assert done.returncode == 1
    assert f"Unknown command: '{command}'" in done.stderr
