"""The node-side jobs take the protocol of what they use (cubelet/ports.py), never the whole Cubelet: none of them
imports `lifecycle.Cubelet`, so a reader of its signatures sees its handful of members. That the Cubelet satisfies
each port is mypy's proof at every call site."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import cubeaccel.cubelet

PACKAGE = Path(cubeaccel.cubelet.__file__).parent
NARROWED = (
    "reconcile",
    "operator",
    "inventory",
    "quarantine_retry",
    "heartbeat",
    "metrics",
    "warm",
    "host_ready",
    "backend_facts",
    "status_push",
    "scrub_ready",
    "snapshots",
    "network_update",
)
# the one function outside the composition root still handed the whole Cubelet: it attaches the metrics to it
ATTACHES = {"metrics": {"metrics_of"}}


def _whole_cubelet_users(module: str) -> set[str]:
    """The functions (and `<module>` for a module-level import) of `module` that name `lifecycle.Cubelet`."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    imported = any(
        isinstance(node, ast.ImportFrom)
        and node.module == "cubeaccel.cubelet.lifecycle"
        and any(a.name == "Cubelet" for a in node.names)
        for node in ast.walk(tree)
    )
    if not imported:
        return set()
    users = {
        fn.name
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef)
        and any(
            isinstance(n, ast.Name) and n.id == "Cubelet"
            for a in fn.args.args
            if a.annotation
            for n in ast.walk(a.annotation)
        )
    }
    return users or {"<module>"}


@pytest.mark.parametrize("module", NARROWED)
def test_a_node_job_takes_a_port_not_the_whole_cubelet(module: str) -> None:
    assert _whole_cubelet_users(module) <= ATTACHES.get(module, set())
