"""Run the test suite: ``python3 scripts/test.py [pytest arguments]``.

Installs the project and its test tools into ``.venv`` first (scripts/environment.py).
``TXQUEUE_TEST_DB=sqlite`` (the default, no server), ``postgresql`` or ``mysql`` picks the
database, and the driver it needs is installed with the rest; see tests/settings.py. The
admin's browser tests need Debian's chromium too (``apt install chromium``); without it they
are skipped, except under ``CI=true``.
"""

import os
import subprocess
import sys

import environment

DRIVERS = {"postgresql": ["postgres"], "mysql": ["mysql"]}

database = os.environ.get("TXQUEUE_TEST_DB", "sqlite")
python = environment.ensure(["dev", "example", "browser", *DRIVERS.get(database, [])])
tests = subprocess.run([python, "-m", "pytest", *sys.argv[1:]], cwd=environment.ROOT)
sys.exit(tests.returncode)
