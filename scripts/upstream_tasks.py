"""Run Django's and django-tasks-db's own Tasks tests against TxQueueBackend.

``python scripts/upstream_tasks.py [pytest arguments]``, from the project's environment
(``TXQUEUE_TEST_DB`` picks the database, as for our suite). The pinned source
distributions are fetched with pip into a cache directory (``TXQUEUE_UPSTREAM_CACHE``,
default ``~/.cache/django-txqueue/upstream``) and unpacked there; tests/upstream/
supplies the settings and swaps their backends for ours.
"""

import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(
    os.environ.get("TXQUEUE_UPSTREAM_CACHE", Path.home() / ".cache/django-txqueue/upstream")
)
DJANGO = "Django==6.1.3"
TASKS_DB = "django-tasks-db==0.13.0"


def fetch(requirement: str, *parts: str) -> Path:
    """The unpacked sdist of ``requirement`` (only ``parts`` of it), fetched once."""
    name, version = requirement.split("==")
    where = CACHE / f"{name}-{version}"
    if not all((where / part).exists() for part in parts):
        where.mkdir(parents=True, exist_ok=True)
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        subprocess.run([*pip, "-q", "-d", str(where), requirement], check=True)
        (sdist,) = where.glob("*.tar.gz")
        with tarfile.open(sdist) as archive:
            members = []
            for member in archive.getmembers():
                member.name = member.name.partition("/")[2]
                if any(member.name.startswith(part) for part in parts):
                    members.append(member)
            archive.extractall(where, members=members, filter="data")
    return where


def main() -> int:
    django = fetch(DJANGO, "tests/tasks/")
    tasks_db = fetch(TASKS_DB, "django_tasks_db/", "django_tasks_db.egg-info/", "tests/tests.py")
    # Their test module is named tests.py, in a directory named tests: that name is our
    # test package's, so it runs under a name of its own.
    suite = CACHE / "django_tasks_db_tests" / "test_django_tasks_db.py"
    suite.parent.mkdir(exist_ok=True)
    suite.write_bytes((tasks_db / "tests/tests.py").read_bytes())
    command = [sys.executable, "-m", "pytest", "-c", "tests/upstream/pytest.ini"]
    command += ["--rootdir", str(CACHE), str(django / "tests/tasks"), str(suite)]
    # Ours first (tests is our package), then django_tasks_db, and Django's tests/ (the
    # tasks their suites enqueue: tasks.tasks, django-tasks-db's tests.tasks).
    path = [str(ROOT), str(tasks_db), str(django / "tests")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    return subprocess.run([*command, *sys.argv[1:]], cwd=ROOT, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
