"""Fixtures of the example project's end-to-end tests; the helpers are in example.py."""

import pytest

from .example import VENDOR, Example, database_url, example_env, manage, quoted_name, run_ddl


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
