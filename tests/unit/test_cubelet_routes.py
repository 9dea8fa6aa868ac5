"""Where the Cubelet's routes live: each a module-level function of a router in `cubelet/api/` that a reader (or a
tool) can open on its own, none a closure of `create_app`, and each router module short enough to read whole."""

from __future__ import annotations

import inspect
from pathlib import Path

from fastapi import FastAPI

from cubeaccel.cubelet.api import local_only
from cubeaccel.cubelet.server import ROUTERS, create_app
from tests.support.cubelet_harness import Node

API = Path(inspect.getfile(local_only)).parent


def _apps(tmp_path: Path) -> list[FastAPI]:
    node = Node.create(tmp_path)
    return [create_app(node.cubelet, local=True), create_app(node.cubelet, local=False, token="t" * 32)]


def test_create_app_defines_no_route_of_the_cubelet_itself(tmp_path: Path) -> None:
    for app in _apps(tmp_path):
        ours = [r for r in app.routes if getattr(r, "endpoint", None) is not None]
        ours = [r for r in ours if r.endpoint.__module__.startswith("cubeaccel.")]  # type: ignore[attr-defined]
        assert [r for r in ours if "<locals>" in r.endpoint.__qualname__] == []  # type: ignore[attr-defined]


def test_every_route_is_a_module_level_function_of_a_router_in_cubelet_api() -> None:
    routes = [route for router in (*ROUTERS, local_only.router) for route in router.routes]
    assert len(routes) == 24  # the 22 both listeners serve, and shim reports and reconcile on the unix socket
    for route in routes:
        endpoint = route.endpoint  # type: ignore[attr-defined]
        assert endpoint.__module__.startswith("cubeaccel.cubelet.api."), route
        assert endpoint.__qualname__ == endpoint.__name__, route  # not nested in a function or class


def test_each_module_of_the_cubelet_api_is_short_enough_to_read_whole() -> None:
    lengths = {p.name: len(p.read_text().splitlines()) for p in API.glob("*.py")}
    assert {name: n for name, n in lengths.items() if n > 300} == {}
