"""Every relative link in the project's Markdown points at a file that exists: documentation moved
between pages (README, docs/, docs/results/) must not leave a reader at a dead link."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(
    {
        *ROOT.glob("*.md"),
        *ROOT.glob("docs/**/*.md"),
        *ROOT.glob("src/**/*.md"),
        *ROOT.glob("helm/**/*.md"),
        *ROOT.glob("tests/**/*.md"),
    }
)
_FENCE = re.compile(r"```.*?```", re.S)
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _relative_links(page: Path) -> list[str]:
    text = _FENCE.sub("", page.read_text(encoding="utf-8"))  # code blocks hold no links
    links = [m.group(1) for m in _LINK.finditer(text)]
    return [t for t in links if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def test_there_are_pages_to_check() -> None:
    assert len(PAGES) >= 10 and ROOT / "README.md" in PAGES


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    dead = [t for t in _relative_links(page) if not (page.parent / t.split("#")[0]).exists()]
    assert not dead, f"{page.relative_to(ROOT)}: dead links {dead}"
