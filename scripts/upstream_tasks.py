"""Run Django's and django-tasks-db's own Tasks tests against TxQueueBackend.

``python scripts/upstream_tasks.py [pytest arguments]``, from the project's environment
(``TXQUEUE_TEST_DB`` picks the database, as for our suite). The pinned source
distributions are fetched with pip into a cache directory (``TXQUEUE_UPSTREAM_CACHE``,
default ``~/.cache/django-txqueue/upstream``) and only their tests are unpacked there;
tests/upstream/ supplies the settings and swaps their backends for ours.
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
# Requirement -> the test directory of its sdist that we run.
SUITES = {"Django==6.1.3": "tests/tasks"}


def fetch(requirement: str, tests: str) -> Path:
    """The unpacked test directory of ``requirement``'s sdist, fetched once."""
    name, version = requirement.split("==")
    where = CACHE / f"{name}-{version}"
    if not (where / tests).is_dir():
        where.mkdir(parents=True, exist_ok=True)
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        subprocess.run([*pip, "-q", "-d", str(where), requirement], check=True)
        (sdist,) = where.glob("*.tar.gz")
        with tarfile.open(sdist) as archive:
            top = archive.getnames()[0].split("/")[0]
            members = [m for m in archive.getmembers() if m.name.startswith(f"{top}/{tests}/")]
            for member in members:
                member.name = member.name.removeprefix(f"{top}/")
            archive.extractall(where, members=members, filter="data")
    return where / tests


def main() -> int:
    paths = [str(fetch(requirement, tests)) for requirement, tests in SUITES.items()]
    command = [sys.executable, "-m", "pytest", "-c", "tests/upstream/pytest.ini"]
    command += ["--rootdir", str(CACHE), *paths, *sys.argv[1:]]
    return subprocess.run(
        command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}
    ).returncode


if __name__ == "__main__":
    sys.exit(main())
