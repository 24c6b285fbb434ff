"""Settings of the Django processes the PgBouncer tests start (``pgbouncer.PgBouncer``):
the suite's, with DATABASES replaced by TXQUEUE_PGBOUNCER_DATABASES (JSON)."""

import json
import os

from tests.settings import *  # noqa: F403

DATABASES = json.loads(os.environ["TXQUEUE_PGBOUNCER_DATABASES"])
