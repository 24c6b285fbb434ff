"""Build the documentation site: ``python3 scripts/docs.py [OUTPUT_DIR]``.

Installs the ``docs`` extra into the environment of scripts/environment.py (``.venv``), then
runs Sphinx with warnings as errors (``-W --keep-going``) and nitpicky cross-references
(``-n``): a Markdown link to a missing page or heading, an unresolved reference, a page in no
table of contents or a docstring Sphinx cannot read fails the build. Then every relative link
and anchor in the built HTML is checked, offline: external links are never fetched.
Writes ``docs/_build/html`` unless given another directory.
"""

from __future__ import annotations

import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import environment

ROOT = environment.ROOT


class Page(HTMLParser):
    """The ids a built page defines and the relative links it makes."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name == "id" and value:
                self.ids.add(value)
            if name in ("href", "src") and value and tag != "link":
                self.links.append(value)


def broken_links(site: Path) -> list[str]:
    pages: dict[Path, Page] = {}
    for path in site.rglob("*.html"):
        page = Page()
        page.feed(path.read_text(encoding="utf-8"))
        pages[path.resolve()] = page
    problems = []
    for path, page in sorted(pages.items()):
        for link in page.links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or link.startswith(("mailto:", "javascript:")):
                continue  # external: never fetched
            target = (path.parent / unquote(parts.path)).resolve() if parts.path else path
            if target.is_dir():
                target = target / "index.html"
            where = f"{path.relative_to(site.resolve())}: {link}"
            if not target.exists():
                problems.append(f"{where} (no such file)")
            elif parts.fragment and target in pages and parts.fragment not in pages[target].ids:
                problems.append(f"{where} (no such anchor)")
    return problems


def main() -> int:
    output = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "_build" / "html"
    python = environment.ensure(["docs"])
    started = time.monotonic()
    build = [str(python), "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-E", "-b", "html"]
    if subprocess.run([*build, str(ROOT / "docs"), str(output)]).returncode != 0:
        print("FAIL: the documentation has warnings (above)", file=sys.stderr)
        return 1
    problems = broken_links(output)
    for problem in problems:
        print(f"broken link: {problem}", file=sys.stderr)
    if problems:
        return 1
    print(f"Built {output} in {time.monotonic() - started:.1f} s; every relative link resolves.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
