"""The Cubelet is built whole in one place (`cubelet/runtime.py::assemble`): no part is attached to it afterwards,
none is probed for with `getattr`, and the release path is an object of its own that reads no Cubelet."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from cubeaccel.backends.vfio import VfioBackend
from cubeaccel.cubelet.inventory import initialize_host
from cubeaccel.cubelet.lifecycle import ReservationRequest
from cubeaccel.cubelet.release import ReleasePath
from cubeaccel.cubelet.runtime import assemble
from cubeaccel.cubelet.shim_driver import SimulatedShimDriver
from cubeaccel.cubelet.store import Store
from cubeaccel.host.pci.simulated import SimulatedPciHost
from cubeaccel.host.service.audit import AuditLog, read
from cubeaccel.model.states import DeviceState

SRC = Path(__file__).resolve().parents[2] / "src" / "cubeaccel"
NODE_SIDE = [*(SRC / "cubelet").glob("*.py"), SRC / "cli" / "cubelet.py"]
OWNERS = {"self", "cubelet"}  # the Cubelet itself, or a part holding it


def _owner(node: ast.expr) -> str | None:
    """`cubelet` for `cubelet.x`, `self.cubelet.x` and `self.x` (the last only inside the Cubelet's classes)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def _findings(path: Path) -> list[str]:
    out = []
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            for t in targets:
                if isinstance(t, ast.Attribute) and _owner(t.value) == "cubelet":
                    out.append(f"{path.name}:{n.lineno}: assigns cubelet.{t.attr}")
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "getattr" and n.args:
            owner = _owner(n.args[0])
            if owner in OWNERS or (isinstance(n.args[0], ast.Attribute) and _owner(n.args[0].value) == "cubelet"):
                probed = ast.unparse(n.args[1]) if len(n.args) > 1 else "?"
                out.append(f"{path.name}:{n.lineno}: probes {ast.unparse(n.args[0])} for {probed}")
    return out


def test_nothing_on_the_node_side_attaches_a_part_to_the_cubelet_or_probes_it_with_getattr() -> None:
    found = [f for p in sorted(NODE_SIDE) for f in _findings(p)]
    assert found == []


def test_the_release_path_is_given_its_collaborators_and_reads_no_cubelet() -> None:
    given = set(inspect.signature(ReleasePath).parameters)
    assert {"journal", "backend", "shim", "scrub_runner", "device_locks", "status_sink", "audit"} <= given
    tree = ast.parse((SRC / "cubelet" / "release.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "cubeaccel.cubelet.lifecycle" not in imported
    assert "cubelet" not in {a.arg for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) for a in n.args.args}


def test_a_cubelet_built_with_an_audit_log_audits_custody_from_its_first_event(tmp_path: Path) -> None:
    """Before, the custody audit was attached by the server once the node served: what host initialization did
    to each device was not in it. Built whole, the node audits from the first event."""
    host = SimulatedPciHost("h100x2", tmp_path / "host.json")
    cubelet = assemble(
        Store(tmp_path / "cubelet.db"),
        VfioBackend(host, allow=("10de:*",)),
        SimulatedShimDriver(host),
        audit=AuditLog(tmp_path / "audit.jsonl"),
    )
    initialize_host(cubelet)
    assert isinstance(cubelet.release_path, ReleasePath)
    devices = {d.id for d in cubelet.store.devices() if d.state is DeviceState.ALLOCATABLE}
    assert len(devices) == 2
    audited = {e["device"] for e in read(tmp_path / "audit.jsonl") if e["action"] == "device:validated"}
    assert audited == devices

    res = cubelet.reserve("sb-audited", ReservationRequest(count=1))
    cubelet.start("sb-audited")
    cubelet.release("sb-audited")
    (dev,) = res.device_ids
    trail = [e["action"] for e in read(tmp_path / "audit.jsonl") if e.get("device") == dev]
    assert trail[-1] == "device:allocatable" and "device:scrubbed" in trail, trail
    cubelet.store.close()
