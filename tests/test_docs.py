"""The settings reference (docs/reference/settings.md) names every key the code accepts.

It reads the Markdown source, not the built site, so it needs no Sphinx: a key added to
``conf.DEFAULTS``, ``conf.QUEUE_KEYS`` or the schedule's ``KEYS`` without a row in its table
fails here. The site itself is built, warnings as errors, by ``scripts/docs.py`` in CI.
"""

import re
from pathlib import Path

import pytest

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
