"""The repository stands alone: no tracked file sends a reader or a program to the team's shared directory beside
the clone. CI has that directory; a user's clone does not, so anything that needs it breaks there and only there."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# `../shared/…`, `/work/shared/…`, or a bare `shared/notes|seed/…` citation of the team's directory.
OUTSIDE = re.compile(r"\.\./shared/|/work/shared\b|(?<![\w/.-])shared/(?:notes|seed|hooks)/")


def _tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / name for name in out.decode().split("\0") if name]


def references_outside(text: str) -> list[str]:
    """Each line of `text` that names a file outside the repository."""
    return [line.strip() for line in text.splitlines() if OUTSIDE.search(line)]


# The checks of this rule, which name such paths on purpose as their examples.
CHECKERS = {Path(__file__).resolve(), ROOT / "tests" / "unit" / "test_docs_paths.py"}


def test_no_tracked_file_names_the_shared_directory() -> None:
    found = []
    for path in _tracked():
        if path in CHECKERS or not path.is_file():
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        found += [f"{path.relative_to(ROOT)}: {line}" for line in references_outside(text)]
    assert found == []


def test_the_check_finds_each_way_of_naming_it() -> None:
    text = "\n".join(
        [
            "see ../shared/notes/x.md",
            "or /work/shared/seed/y.txt",
            "or shared/notes/z.md",
            "fine: shared memory, docs/shared/x.md",
        ]
    )
    assert len(references_outside(text)) == 3
