"""The user documentation: every relative link in README.md and docs/ points at a file
that exists, and none of it cites the development log (numbered sessions or issues) or
files outside the repository."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]


def links(page: Path) -> list[str]:
    return [t for t in re.findall(r"\]\(([^)#\s]+)", page.read_text()) if "://" not in t]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_resolve(page):
    missing = [t for t in links(page) if not (page.parent / t).exists()]
    assert not missing, f"{page.name} links to missing files: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_development_log(page):
    text = page.read_text()
    found = re.findall(r"\b(?:[Ss]ession|[Ii]ssue) #?\d+|\.\./shared/", text)
    assert not found, f"{page.name} cites the development log: {sorted(set(found))}"


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
