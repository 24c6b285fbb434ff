"""The docs hold what the code does: the settings reference (docs/reference/settings.md) names
every key the code accepts, and docs/architecture.md's map every module of the package.

It reads the Markdown source, not the built site, so it needs no Sphinx: a key added to
``conf.DEFAULTS``, ``conf.QUEUE_KEYS`` or the schedule's ``KEYS`` without a row in its table
fails here. The site itself is built, warnings as errors, by ``scripts/docs.py`` in CI.
"""

import re
from pathlib import Path

import pytest

import django_txqueue
from django_txqueue import conf, schedule

REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "reference" / "settings.md"


def table_keys(heading: str) -> set[str]:
    """The keys in the first column of the table under ``## heading``."""
    text = REFERENCE.read_text()
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    keys: set[str] = set()
    for cells in re.findall(r"^\| (.+?) \|", section, re.MULTILINE):
        keys.update(re.findall(r"`([A-Z_]+)`", cells))
    return keys


@pytest.mark.parametrize(
    ("heading", "expected"),
    [
        ("Top-level keys", set(conf.DEFAULTS)),
        ("Per-queue keys: `QUEUES`", set(conf.QUEUE_KEYS)),
        ("Schedule entries: `SCHEDULE`", set(schedule.KEYS)),
    ],
)
def test_every_key_has_a_row(heading, expected):
    documented = table_keys(heading)
    assert expected - documented == set(), f"undocumented in {REFERENCE.name}, {heading}"
    assert documented - expected == set(), f"documented but unknown, {heading}"


def test_every_check_id_is_documented():
    """Each system check id the package emits appears in the settings reference."""
    source = "".join(
        path.read_text()
        for path in (REFERENCE.parent.parent.parent / "django_txqueue").glob("*.py")
    )
    emitted = set(re.findall(r'id="(txqueue\.[EW]\d{3})"', source))
    text = REFERENCE.read_text()
    documented = set(re.findall(r"txqueue\.[EW]\d{3}", text))
    documented |= {f"txqueue.{code}" for code in re.findall(r"\b([EW]\d{3})\b", text)}
    assert emitted, "no check ids found: the pattern no longer matches checks.py"
    assert emitted - documented == set()


# -- docs/architecture.md's map ----------------------------------------------------------

ARCHITECTURE = REFERENCE.parent.parent / "architecture.md"
PACKAGE = Path(django_txqueue.__file__).resolve().parent


def map_entries(text: str) -> list[str]:
    """The paths the map names, in order: the names before each line's description (two
    spaces or more), comma-separated; a folder (``consumer/``) stands for its
    ``__init__.py``, ``migrations/`` for the whole folder."""
    block = text.split("\n## The map\n", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    entries: list[str] = []
    for line in block.splitlines():
        names = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        entries += [name.strip() for name in names.split(",") if name.strip()]
    return entries


def package_modules() -> list[str]:
    return sorted(
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if "migrations" not in path.relative_to(PACKAGE).parts
    )


def test_every_module_is_in_the_architecture_map_once():
    entries = [
        f"{entry}__init__.py" if entry.endswith("/") else entry
        for entry in map_entries(ARCHITECTURE.read_text())
        if entry != "migrations/"
    ]
    repeated = sorted({entry for entry in entries if entries.count(entry) > 1})
    assert repeated == [], "named more than once in docs/architecture.md's map"
    assert sorted(set(package_modules()) - set(entries)) == [], "missing from the map"
    assert sorted(set(entries) - set(package_modules())) == [], "in the map, not a module"


def test_the_map_is_read_name_by_name():
    text = (
        "\n## The map\n\n```text\napi.py  producing\nurls.py, api.py  again\nstore/  rows\n```\n"
    )
    assert map_entries(text) == ["api.py", "urls.py", "api.py", "store/"]
