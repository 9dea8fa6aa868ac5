"""A class name defined twice in src/ sends a reader (and an import) to the wrong one unless the code says why both
exist: for each pair, one definition's comment just above it or its docstring names the other's module."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "cubeaccel"


def _definitions() -> dict[str, list[tuple[Path, str]]]:
    """Public top-level class name -> (file, the comment lines above it plus its docstring)."""
    found: dict[str, list[tuple[Path, str]]] = defaultdict(list)
    for path in sorted(SRC.rglob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.parse("\n".join(lines)).body:
            if not isinstance(node, ast.ClassDef) or node.name.startswith("_"):
                continue
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
            above = []
            while first > 0 and lines[first - 1].lstrip().startswith("#"):
                first -= 1
                above.append(lines[first])
            found[node.name].append((path, "\n".join(above) + "\n" + (ast.get_docstring(node) or "")))
    return found


def test_every_class_name_defined_twice_says_why_both_exist() -> None:
    unexplained = []
    for name, defs in sorted(_definitions().items()):
        for i, (a, a_says) in enumerate(defs):
            for b, b_says in defs[i + 1 :]:
                if b.stem not in a_says and a.stem not in b_says:
                    unexplained.append(f"{name}: {a.relative_to(SRC)} and {b.relative_to(SRC)}")
    assert not unexplained, "class names defined twice with no comment naming the other:\n" + "\n".join(unexplained)
