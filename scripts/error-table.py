"""Regenerate the error table in docs/api.md from src/cubeaccel/protocol/error_catalog.py (between its markers)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from cubeaccel.protocol.error_catalog import markdown  # noqa: E402

BEGIN, END = "<!-- BEGIN error-catalog", "<!-- END error-catalog -->"


def main() -> int:
    doc_path = ROOT / "docs" / "api.md"
    doc = doc_path.read_text()
    start = doc.index("\n", doc.index(BEGIN)) + 1
    end = doc.index(END)
    doc_path.write_text(doc[:start] + markdown() + doc[end:])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
