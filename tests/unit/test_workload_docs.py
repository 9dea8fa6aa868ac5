"""docs/workload.md documents every mux error code, and the code raises no code it does not list."""

from __future__ import annotations

import re
from pathlib import Path

from cubeaccel.protocol.mux import ERROR_CODES

ROOT = Path(__file__).resolve().parents[2]


def test_every_mux_error_code_is_listed_and_documented() -> None:
    raised = set(re.findall(r'"(mux\.[a-z_]+)"', (ROOT / "src/cubeaccel/protocol/mux.py").read_text()))
    assert raised == set(ERROR_CODES)
    doc = (ROOT / "docs" / "workload.md").read_text()
    assert sorted(c for c in ERROR_CODES if f"`{c}`" not in doc) == []
