"""The database of a benchmark script (``python -m benchmarks.admin`` and its
neighbours), run by hand, never by pytest: its own, so a run never touches the test
database. The scripts print a table and assert nothing a noisy machine could fail.
"""

import os
import re
import tempfile


def prepare_database(vendor: str, name: str) -> None:
    """Point the test settings at the bench's own database ``name`` (created if missing;
    on SQLite a temp file), then set Django up and migrate."""
    if vendor == "sqlite":
        os.environ["TXQUEUE_TEST_NAME"] = os.path.join(tempfile.mkdtemp(), "bench.sqlite3")
    else:
        # A name in DDL takes no parameter: allow letters, digits and _ only.
        if not re.fullmatch(r"\w+", name):
            raise SystemExit(f"A bench database name is letters, digits and _: {name!r}")
        os.environ["TXQUEUE_TEST_NAME"] = name
        if vendor == "postgresql":
            import psycopg

            with psycopg.connect(
                host="127.0.0.1", user="postgres", dbname="postgres", autocommit=True
            ) as conn:
                found = "SELECT 1 FROM pg_database WHERE datname = %s"
                if not conn.execute(found, [name]).fetchone():
                    conn.execute(f'CREATE DATABASE "{name}"')
        else:
            import MySQLdb

            conn = MySQLdb.connect(host="127.0.0.1", user="root")
            conn.cursor().execute(f"CREATE DATABASE IF NOT EXISTS `{name}`")
            conn.close()
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)
