"""docs/compatibility.md documents every error code the contract code can produce."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [
    "src/cubeaccel/model/registration_checks.py",
    "src/cubeaccel/model/guest_checks.py",
    "src/cubeaccel/model/contract.py",
    "src/cubeaccel/model/versions.py",
    "src/cubeaccel/model/template_spec.py",
    "src/cubeaccel/model/sandbox_policy.py",
    "src/cubeaccel/wire/templates.py",
]
CODE = re.compile(r'"((?:compat|template|version|contract)\.[a-z_]+)"')


def test_every_error_code_is_documented_with_an_example() -> None:
    codes = {c for src in SOURCES for c in CODE.findall((ROOT / src).read_text())}
    assert len(codes) > 60
    doc = (ROOT / "docs" / "compatibility.md").read_text()
    undocumented = sorted(c for c in codes if f"`{c}`" not in doc)
    assert undocumented == []
