"""See the whole product work: ``python3 scripts/demo.py [demo options]``.

Installs django-txqueue and what the example project needs into ``.venv``
(scripts/environment.py), then runs ``example_project/manage.py demo``: on SQLite, or on
the database ``DATABASE_URL`` names (``postgres://...``, ``mysql://...``).
"""

import os
import subprocess
import sys

import environment

DRIVERS = {"postgres": ["postgres"], "mysql": ["mysql"]}

scheme = os.environ.get("DATABASE_URL", "").split(":", 1)[0]
driver = next((extras for prefix, extras in DRIVERS.items() if scheme.startswith(prefix)), [])
python = environment.ensure(["example", *driver])
manage = environment.ROOT / "example_project" / "manage.py"
sys.exit(subprocess.run([python, manage, "demo", *sys.argv[1:]]).returncode)
