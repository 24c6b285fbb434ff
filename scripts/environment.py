"""The virtual environment that scripts/demo.py and scripts/test.py run in, made on first use.

Only the standard library: this runs before anything is installed. The environment is
``.venv`` in the checkout (``TXQUEUE_VENV`` moves it, ``TXQUEUE_DJANGO`` pins Django, e.g.
``"Django>=5.2,<6.0"``). What was installed is remembered in the environment, so a later
run installs only what is new, and nothing when nothing is.

    python3 scripts/environment.py EXTRA ...   # make it; print its Python
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HINTS = {
    "mysql": "mysqlclient compiles against the MySQL client headers: on Debian or Ubuntu, "
    "apt install libmariadb-dev pkg-config",
    "browser": "The browser tests drive Debian's chromium at /usr/bin/chromium (Playwright "
    "never downloads one here): apt install chromium",
}
# What an extra needs from outside pip: its hint is printed when this path is missing.
SYSTEM = {"browser": Path("/usr/bin/chromium")}


def ensure(extras: list[str]) -> Path:
    """The environment's Python, with this checkout and its ``extras`` installed."""
    if sys.version_info < (3, 11):
        sys.exit(f"django-txqueue needs Python 3.11 or newer; this is {sys.version.split()[0]}.")
    venv = Path(os.environ.get("TXQUEUE_VENV") or ROOT / ".venv")
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    if not python.exists():
        print(f"--- creating {venv}", file=sys.stderr, flush=True)
        if subprocess.run([sys.executable, "-m", "venv", str(venv)]).returncode != 0:
            sys.exit(
                "Could not create a virtual environment. On Debian or Ubuntu the venv module "
                "is a package of its own: apt install python3-venv"
            )
    record = venv / "txqueue-installed.json"
    django = os.environ.get("TXQUEUE_DJANGO", "")
    project = (ROOT / "pyproject.toml").read_text()
    installed = json.loads(record.read_text()) if record.exists() else {}
    if installed.get("project") != project or installed.get("django") != django:
        installed = {"project": project, "django": django, "extras": []}
    wanted = sorted(set(installed["extras"]) | set(extras))
    if wanted != installed["extras"] or not record.exists():
        install(python, wanted, django)
        record.write_text(json.dumps({**installed, "extras": wanted}))
    for extra in wanted:
        if extra in SYSTEM and not SYSTEM[extra].exists():
            print(f"--- {HINTS[extra]}", file=sys.stderr, flush=True)
    return python


def install(python: Path, extras: list[str], django: str) -> None:
    requirement = f"{ROOT}[{','.join(extras)}]"
    print(f"--- installing {requirement} {django}", file=sys.stderr, flush=True)
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    if subprocess.run([*pip, "-e", requirement, *filter(None, [django])]).returncode != 0:
        hints = [HINTS[extra] for extra in extras if extra in HINTS]
        sys.exit("Installing failed (pip's message is above). " + " ".join(hints))


if __name__ == "__main__":
    print(ensure(sys.argv[1:]))
