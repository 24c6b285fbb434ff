"""The README's quick start, as a new user follows it: a fresh ``startproject`` with the
settings snippet added as written (its ``...`` standing for the project's own apps) checks
without a warning, migrates, and enqueues and runs an item."""

import os
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT, child_env

pytestmark = pytest.mark.slow


def quick_start_settings():
    """The first Python block of the README's "Quick start": its settings snippet."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL)[1]


def django(project, *args):
    env = {**child_env(), "DJANGO_SETTINGS_MODULE": "site_config.settings"}
    env.pop("TXQUEUE_TEST_SETTINGS", None)
    return subprocess.run(  # noqa: S603 - our own command line
        [sys.executable, "manage.py", *args],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_quick_start_gives_a_project_without_warnings(tmp_path):
    current = os.environ.get("TXQUEUE_TEST_DB", "sqlite")
    if current != "sqlite":  # a new project's database; one run of the suite is enough
        pytest.skip(f"runs with TXQUEUE_TEST_DB=sqlite (this run: {current})")
    snippet = quick_start_settings()
    assert 'INSTALLED_APPS = [..., "django_txqueue"]' in snippet
    subprocess.run(  # noqa: S603
        [sys.executable, "-m", "django", "startproject", "site_config", str(tmp_path)],
        check=True,
        env=child_env(),
    )
    (tmp_path / "bookings").mkdir()
    (tmp_path / "bookings" / "__init__.py").write_text("")
    (tmp_path / "bookings" / "queues.py").write_text(
        "from django_txqueue import handler\n\n"
        "@handler('sms')\n"
        "def send_sms(item):\n"
        "    return {'sent': item.payload['booking']}\n"
    )
    settings = tmp_path / "site_config" / "settings.py"
    as_written = snippet.replace("[...,", "[*INSTALLED_APPS,")  # "..." is the project's apps
    settings.write_text(
        settings.read_text() + "\n" + as_written + "\nINSTALLED_APPS.append('bookings')\n"
    )

    checked = django(tmp_path, "check")
    assert checked.returncode == 0, checked.stderr
    assert "System check identified no issues" in checked.stdout, checked.stdout + checked.stderr
    assert "txqueue.W" not in checked.stdout + checked.stderr

    migrated = django(tmp_path, "migrate", "-v", "0")
    assert migrated.returncode == 0, migrated.stderr
    shell = "from django_txqueue import enqueue; print(enqueue('sms', {'booking': 12}).pk)"
    assert django(tmp_path, "shell", "-v", "0", "-c", shell).stdout.strip() == "1"
    ran = django(tmp_path, "run_queue_consumer", "--burst", "-v", "0")
    assert ran.returncode == 0, ran.stderr
    result = "from django_txqueue import QueueItem; print(QueueItem.objects.get().result)"
    assert django(tmp_path, "shell", "-v", "0", "-c", result).stdout.strip() == "{'sent': 12}"
