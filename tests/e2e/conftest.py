"""Fixtures of the end-to-end tests: the example project's (helpers in example.py) and the
throwaway servers' (helpers in servers.py)."""

import pytest

from .example import VENDOR, Example, database_url, example_env, manage, quoted_name, run_ddl
from .servers import DBNAME, SERVERS, django, needs_servers


@pytest.fixture(scope="module")
def example_database(tmp_path_factory):
    """The DATABASE_URL of a migrated database for the example, dropped afterwards."""
    if VENDOR == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('example') / 'cinema.sqlite3'}"
        drop = ()
    else:
        name = quoted_name()
        charset = "" if VENDOR == "postgresql" else " CHARACTER SET utf8mb4"
        force = " WITH (FORCE)" if VENDOR == "postgresql" else ""
        drop = (f"DROP DATABASE IF EXISTS {name}{force}",)
        run_ddl(*drop, f"CREATE DATABASE {name}{charset}")
        url = database_url()
    try:
        manage(["migrate", "-v", "0"], example_env(url))
        yield url
    finally:
        if drop:
            run_ddl(*drop)


@pytest.fixture
def example(example_database, tmp_path):
    return Example(example_database, tmp_path / "gateway.sqlite3")


@pytest.fixture(scope="module", params=sorted(SERVERS))
def server(request):
    """A throwaway server of one kind with the test database migrated, for the module.

    Its tests run in the suite run of the same kind (``TXQUEUE_TEST_DB=postgresql`` or
    ``mysql``), so that CI's passes do not repeat them: the parameter picks which server
    binaries to start, not a feature. A machine without them skips, except under
    ``CI=true``, where that is a failure."""
    kind = request.param
    server_class = SERVERS[kind]
    needs_servers(kind, server_class.missing(), f"the {kind} restart tests")
    instance = server_class()
    request.addfinalizer(instance.destroy)
    instance.start()
    instance.create_database(DBNAME)
    django(instance, "migrate", "--noinput", "-v", "0")
    return instance
