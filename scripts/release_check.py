"""Check that this checkout makes a releasable package: ``python scripts/release_check.py``.

Run with an interpreter that has the ``release`` extra (``build`` and ``twine``), as CI's
environment does. In a temporary directory it:

1. builds the sdist and the wheel (``python -m build``: the wheel is built from the sdist,
   so a file the sdist forgets is missing from the wheel too);
2. runs ``twine check --strict`` on both, as PyPI would read their metadata;
3. compares the wheel's files with the package's (every module, template, static file,
   migration and ``py.typed``; no tests, benchmarks, scripts or example project), and the
   sdist's the same way;
4. makes a fresh virtualenv, installs the wheel with its ``example`` extra, and runs the
   example project's ``demo`` and ``txqueue_health`` from a copy of ``example_project``
   outside the checkout, so only the installed package can be imported.

It prints each check and exits 1 at the first failure. Only the standard library; pip
reaches the package index for Django and the example's dependencies.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "django_txqueue"
# The kinds of files the wheel must hold besides modules, each with one it must have.
REQUIRED = [
    f"{PACKAGE}/py.typed",
    f"{PACKAGE}/migrations/0001_initial.py",
    f"{PACKAGE}/templates/admin/{PACKAGE}/queueitem/stuck.html",
    f"{PACKAGE}/static/{PACKAGE}/dashboard.js",
    f"{PACKAGE}/management/commands/txqueue_health.py",
]
FORBIDDEN = re.compile(r"(^|/)(tests|benchmarks|scripts|example_project|docs|__pycache__)/|\.pyc$")
started = time.monotonic()


def step(text: str) -> None:
    print(f"[{time.monotonic() - started:5.1f} s] {text}", flush=True)


def fail(text: str) -> None:
    sys.exit(f"FAIL: {text}")


def run(*command: str | Path, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    """Run ``command``; its output, or the output and a failure when it fails."""
    done = subprocess.run(
        [str(part) for part in command],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        print(done.stdout + done.stderr, file=sys.stderr)
        fail(f"{' '.join(map(str, command))} exited {done.returncode}")
    return done.stdout


def package_files() -> set[str]:
    """The checkout's package files, as paths inside the wheel."""
    found = set()
    for path in (ROOT / PACKAGE).rglob("*"):
        relative = path.relative_to(ROOT).as_posix()
        if path.is_file() and not FORBIDDEN.search(relative) and path.suffix != ".sqlite3":
            found.add(relative)
    return found


def check_wheel(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    metadata = {name for name in names if ".dist-info/" in name}
    files = names - metadata
    if bad := sorted(name for name in files if FORBIDDEN.search(name)):
        fail(f"the wheel holds files it must not: {bad[:10]}")
    if outside := sorted(name for name in files if not name.startswith(f"{PACKAGE}/")):
        fail(f"the wheel holds files outside {PACKAGE}/: {outside[:10]}")
    if missing := sorted(name for name in REQUIRED if name not in files):
        fail(f"the wheel lacks {missing}")
    if missing := sorted(package_files() - files):
        fail(f"the wheel lacks files of the package: {missing[:10]}")
    if not any(name.endswith("/licenses/LICENSE") for name in metadata):
        fail("the wheel's metadata has no LICENSE")
    kinds = {
        "migrations": sum("/migrations/" in name for name in files),
        "templates": sum("/templates/" in name for name in files),
        "static files": sum("/static/" in name for name in files),
    }
    counted = ", ".join(f"{n} {kind}" for kind, n in kinds.items())
    step(f"wheel: {len(files)} files ({counted}, py.typed); no tests, benchmarks, scripts")


def check_sdist(sdist: Path) -> None:
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    files = {name for name in names if not name.endswith("/")}
    if bad := sorted(name for name in files if FORBIDDEN.search(name)):
        fail(f"the sdist holds files it must not: {bad[:10]}")
    wanted = {"pyproject.toml", "README.md", "CHANGELOG.md", "LICENSE", "PKG-INFO"}
    if missing := sorted((wanted | package_files()) - files):
        fail(f"the sdist lacks {missing[:10]}")
    step(f"sdist: {len(files)} files: the package, pyproject.toml, README, CHANGELOG, LICENSE")


def check_installed(wheel: Path, work: Path) -> None:
    venv = work / "venv"
    run(sys.executable, "-m", "venv", venv)
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    quiet = ["--quiet", "--disable-pip-version-check"]
    run(python, "-m", "pip", "install", *quiet, f"{wheel}[example]")
    step(f"installed {wheel.name}[example] in a fresh virtualenv")

    # The example project, copied away from the checkout: its manage.py puts its own
    # parent on sys.path, which must not be the checkout's root.
    project = work / "site" / "example_project"
    shutil.copytree(
        ROOT / "example_project",
        project,
        ignore=shutil.ignore_patterns("__pycache__", "*.sqlite3*"),
    )
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in {"PYTHONPATH", "DJANGO_SETTINGS_MODULE", "DATABASE_URL", "VIRTUAL_ENV"}
    }
    where = run(python, "-c", f"import {PACKAGE}; print({PACKAGE}.__file__)", cwd=work, env=env)
    if not Path(where.strip()).is_relative_to(venv):
        fail(f"{PACKAGE} was imported from {where.strip()}, not the fresh virtualenv")
    step(f"{PACKAGE} imports from the virtualenv: {where.strip()}")

    manage = project / "manage.py"
    output = run(python, manage, "demo", "--seats", "8", cwd=work, env=env)
    last = output.splitlines()[-3:]
    bookings = re.fullmatch(r"Bookings: (\d+)", last[0]) if last else None
    adds_up = [f"SMS sent: {bookings[1]}", "Duplicates: 0"] if bookings else None
    if not (bookings and int(bookings[1]) > 0 and last[1:] == adds_up):
        print(output, file=sys.stderr)
        fail(f"the demo's summary does not add up: {last}")
    step(f"the example's demo against the installed wheel: {' / '.join(last)}")

    run(python, manage, "migrate", "--verbosity", "0", cwd=work, env=env)
    line = run(python, manage, "txqueue_health", cwd=work, env=env).strip()
    if not line.startswith("ok: "):
        fail(f"txqueue_health said {line!r}")
    step(f"txqueue_health against the installed wheel: {line}")


def main() -> None:
    for module in ("build", "twine"):
        if subprocess.run([sys.executable, "-c", f"import {module}"], check=False).returncode:
            fail(f"{module} is not installed: pip install -e '.[release]'")
    with tempfile.TemporaryDirectory(prefix="txqueue-release-") as temporary:
        work = Path(temporary)
        dist = work / "dist"
        run(sys.executable, "-m", "build", "--outdir", dist, ROOT)
        wheels, sdists = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
        if len(wheels) != 1 or len(sdists) != 1:
            fail(f"expected one wheel and one sdist, got {sorted(p.name for p in dist.iterdir())}")
        step(f"built {sdists[0].name} and {wheels[0].name}")
        run(sys.executable, "-m", "twine", "check", "--strict", *wheels, *sdists)
        step("twine check --strict: both pass")
        check_wheel(wheels[0])
        check_sdist(sdists[0])
        check_installed(wheels[0], work)
    step("release check passed")


if __name__ == "__main__":
    main()
