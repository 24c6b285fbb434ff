"""Sphinx configuration of django-txqueue's documentation site.

Build it with ``python scripts/docs.py`` (warnings are errors, every internal link and
cross-reference must resolve, nothing is fetched from the network). The pages are the
Markdown files of this directory, read by MyST-Parser, so GitHub renders the same files.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import django

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path[:0] = [str(ROOT), str(DOCS / "_ext")]

# autodoc imports the package and the management commands build their parsers: a minimal
# project (docs/_ext/docs_settings.py) with the queue app and its optional apps.
os.environ["DJANGO_SETTINGS_MODULE"] = "docs_settings"
django.setup()

project = "django-txqueue"
author = "the django-txqueue authors"
copyright = "2026, the django-txqueue authors"  # noqa: A001 (Sphinx's own name)

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "txqueue_commands",  # docs/_ext: each management command's --help, at build time
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_ext", "screenshots/*.md"]

# Markdown links to "#a-heading" and "page.md#a-heading" resolve, as on GitHub; a link to a
# missing page or anchor is a warning, so an error in CI.
myst_heading_anchors = 4
myst_enable_extensions = ["colon_fence", "deflist"]

# -n: every cross-reference must resolve. No intersphinx (it would fetch inventories), so
# references into Python's and Django's own documentation are named here as known outside.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(django|datetime|collections|typing|contextlib|types|uuid)(\..*)?"),
    (r"py:.*", r"(Any|Callable|Iterable|Iterator|Sequence|Mapping|Generator|TypeVar|P|R|T)"),
    (r"py:.*", r"(QuerySet|Model|Manager|timedelta|datetime|Signal|JSONField)"),
    # The package's type variables, and the internal classes its public ones return or
    # hold (documented through their public methods, not as pages of their own).
    (r"py:class", r"django_txqueue\.[\w.]+\.[A-Z]"),
    (r"py:class", r"django_txqueue\.(consumer\.claims\.Claims|models\.QueueItemQuerySet)"),
    # What step(), chain() and group() return: parts of a flow, whose one method,
    # enqueue(), docs/flows.md and the reference's Flows section describe.
    (r"py:class", r"django_txqueue\.flows\.(Part|Step|Chain|Group)"),
]

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options: dict[str, object] = {}

# External links are never fetched (no linkcheck builder in CI); they render as links.
html_theme = "furo"
html_title = "django-txqueue"
html_static_path: list[str] = []
html_show_sourcelink = False
