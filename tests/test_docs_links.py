"""Every link between the docs' pages finds its page and, when it names one, its heading (as GitHub
makes a heading's anchor: lower case, punctuation dropped, spaces as hyphens, a repeat numbered)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def anchors(page: Path) -> set[str]:
    """The anchors of ``page``'s headings, outside fenced blocks."""
    found: set[str] = set()
    fenced = False
    for line in page.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            n, base = 0, slug
            while slug in found:
                n += 1
                slug = f"{base}-{n}"
            found.add(slug)
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_between_pages_find_their_page_and_heading(page: Path) -> None:
    broken = []
    for match in LINK.finditer(page.read_text()):
        target = match["target"]
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no {path}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {linked.name}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)
