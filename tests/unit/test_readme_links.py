"""README is where a newcomer starts: every page under docs/ is reachable from it by a link, so a page nobody
links (a new component's guide, a spec like scrub.md) cannot sit unread."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# `[text](docs/x.md)` or `[text](docs/x.md#anchor)`; a folder link `[text](docs/openapi/)` covers what it holds.
LINK = re.compile(r"\]\((docs/[^)#\s]+)(?:#[^)\s]*)?\)")


def _linked() -> set[str]:
    return set(LINK.findall(README.read_text()))


@pytest.mark.parametrize("page", sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")))
def test_readme_links_every_page_under_docs(page: str) -> None:
    assert page in _linked(), f"README.md has no link to {page}"


@pytest.mark.parametrize(
    "folder", sorted(p.relative_to(ROOT).as_posix() + "/" for p in (ROOT / "docs").iterdir() if p.is_dir())
)
def test_readme_links_every_folder_under_docs(folder: str) -> None:
    """The generated OpenAPI documents and the evidence files are linked as their folder, not one by one."""
    assert folder in _linked(), f"README.md has no link to {folder}"


def test_every_docs_link_in_readme_resolves() -> None:
    """A link kept after its page moved sends the newcomer nowhere."""
    missing = sorted(link for link in _linked() if not (ROOT / link).exists())
    assert not missing, f"README.md links missing pages: {missing}"
