"""CubeMaster's and the front door's app factories only assemble: no route handler is defined inside one (a
closure no reader or tool can enter without reading the whole factory), and each module of routes stays short
enough to read whole."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "cubeaccel"
FACTORIES = ["master/server.py", "frontdoor/app.py"]
ROUTE_MODULES = sorted(
    str(p.relative_to(SRC)) for d in ("master/api", "frontdoor/routes") for p in (SRC / d).glob("*.py")
)
MAX_LINES = 300


def nested_functions(path: Path, factory: str) -> list[str]:
    """The functions defined anywhere inside `factory` (a lambda is an expression, not a handler)."""
    tree = ast.parse(path.read_text())
    outer = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == factory]
    assert outer, f"{path} has no {factory}"
    return [
        n.name
        for n in ast.walk(outer[0])
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and n is not outer[0]
    ]


@pytest.mark.parametrize("module", FACTORIES)
def test_create_app_defines_no_function_inside_it(module: str) -> None:
    assert nested_functions(SRC / module, "create_app") == []


@pytest.mark.parametrize("module", ROUTE_MODULES)
def test_a_module_of_routes_is_short(module: str) -> None:
    lines = len((SRC / module).read_text().splitlines())
    assert lines <= MAX_LINES, f"{module}: {lines} lines; split it by resource"


def test_the_route_modules_are_found() -> None:
    assert {"master/api/sandboxes.py", "frontdoor/routes/sandboxes.py"} <= set(ROUTE_MODULES)
