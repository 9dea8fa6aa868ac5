"""The error-code catalog is complete, live, consistent with the raise sites, and the docs are generated from it.

The static half scans src/ with `ast`: every code-shaped string literal is a catalogued code or a known
non-code (file names, sysfs attributes, API paths), no code is assembled from pieces, and a raise site that
states its HTTP status states the catalog's. The runtime half is the autouse `catalogued_error_codes` fixture in
tests/conftest.py: every `CubeError` / `ContractViolation` built while any test runs must carry a catalogued code.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cubeaccel.agent import spec as agent_spec
from cubeaccel.agent.userspace import LIBRARY_MISSING
from cubeaccel.model.violations import ContractViolation, Layer
from cubeaccel.protocol import error_catalog
from cubeaccel.protocol.error_catalog import CATALOG, CODES
from cubeaccel.protocol.errors import CubeError

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "cubeaccel"
CODE_SHAPE = re.compile(r"^[a-z][a-z0-9_]*\.[a-z][a-z0-9_]*$")

# Code-shaped literals that are not codes. Adding one here is a decision: say what it is.
NOT_CODES = {
    # file names in state dirs, images and the source tree
    "build.log", "nvidia.py", "packages.py", "preferences.d", "sources.list", "vendor.py",
    "flavour.py", "userland.py", "cert.pem", "nsswitch.conf", "pam.d", "sudoers.d",
    "admin.key", "default.key", "audit.jsonl", "node.token",
    "agent.sock", "workload.sock", "control.sock",
    "builder.py", "console.log", "cpio.py", "cubelet.db", "cubelet.log", "cubelet.sock",
    "initrd.img", "kernel.py", "latest.tmp", "manifest.json", "master.db", "master.log", "meta.json",
    "modules.builtin", "modules.dep", "modules.img", "modules.order", "qmp.sock", "rootfs.cpio", "rootfs.py",
    "shim.pid", "undelivered.jsonl", "up.json", "up.lock", "config.toml", "backup.json", "vmm.log", "vmm.pid",
    "dashboard.html", "spec.json", "shim.log", "base.yaml",
    "frontdoor.secret",
    # the E2B front door's metadata key for an accelerator request
    "cubeaccel.accelerators",
    "scratch.img", "mkfs.ext4",
    "forkserver.log", "forkserver.sock",
    # module names (python -m, loggers)
    "cubeaccel.master", "cubeaccel.shim", "cubeaccel.api", "cubeaccel.cubelet",
    # kernel parameters
    "iommu.passthrough", "iommu.strict", "vfio_iommu_type1.allow_unsafe_interrupts", "vfio_pci.ids",
    # Cloud Hypervisor API endpoints
    "vm.boot", "vm.create", "vm.shutdown", "vmm.ping", "vmm.shutdown",
    # field paths named in error messages
    "by_state.allocatable", "cuda.version", "kernel_driver.module", "kernel_driver.version", "libraries.name",
    "libraries.version", "probes.libraries", "probes.modules", "accelerator.devices",
    # a prefix CubeMaster matches retryable codes by (reserve.pinned_memory_*), not a code itself
    "reserve.pinned_memory",
    # ASGI message types
    "http.disconnect", "http.request", "websocket.close",
    # cgroup v2 interface files (workload/limits.py)
    "cgroup.controllers", "cgroup.procs", "cgroup.subtree_control", "cpu.weight", "memory.max",
    "pids.max",
}  # fmt: skip

# Code-shaped prefixes of f-strings that build messages, not codes.
NOT_CODE_PREFIXES = {"pci.", "pinned_memory."}

# Constructors whose first argument is a code: (the HTTP status they give it, the layer they default to, whether
# the layer is an argument — positional index 2 or keyword). Status None: the `status` argument (positional 4 or
# keyword) decides, and omitted means the catalog's.
CODE_BUILDERS: dict[str, tuple[int | None, str, bool]] = {
    "CubeError": (None, "cubelet", True),
    "HostError": (None, "cubelet", True),
    "StaleRecord": (None, "cubelet", True),
    "TransitionRefused": (None, "cubelet", True),
    "invalid": (422, "api", True),
    "not_found": (404, "api", False),
    "conflict": (409, "cubelet", True),
    "_bad": (422, "api", False),
    "host_error": (500, "host_hardware", False),
    "image_error": (500, "guest_kernel", True),
    "vmm_error": (500, "backend", True),
    "agent_error": (500, "guest_kernel", True),
    "pinned_error": (500, "pinned_memory", False),
    "protocol_error": (400, "agent", False),
    "workload_error": (502, "workload", False),
}
# Codes raised with different layers by different callers (the catalog names the usual one).
LAYER_VARIES = {"device.invalid_address"}


def _modules() -> list[tuple[Path, ast.Module]]:
    return [(p, ast.parse(p.read_text(), str(p))) for p in sorted(SRC.rglob("*.py"))]


def _name(call: ast.Call) -> str | None:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def _literals() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path, tree in _modules():
        for n in ast.walk(tree):
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and CODE_SHAPE.match(n.value):
                found.setdefault(n.value, []).append(f"{path.relative_to(ROOT)}:{n.lineno}")
    return found


def _dotless_reasons() -> set[str]:
    """Failure reasons without a dot (`vmm_exited`): literals given to `begin_teardown` and `release`'s default."""
    out: set[str] = set()
    for _, tree in _modules():
        for n in ast.walk(tree):
            if isinstance(n, ast.Call) and _name(n) == "begin_teardown" and len(n.args) >= 2:
                reason = n.args[1]
                if isinstance(reason, ast.Constant) and isinstance(reason.value, str):
                    out.add(reason.value)
            if isinstance(n, ast.FunctionDef) and n.name == "release":
                for a, d in zip(reversed(n.args.args), reversed(n.args.defaults), strict=False):
                    if a.arg == "reason" and isinstance(d, ast.Constant) and isinstance(d.value, str):
                        out.add(d.value)
    return out


def test_every_code_shaped_literal_in_src_is_catalogued_or_declared_not_a_code() -> None:
    literals = _literals()
    unknown = {c: where[:2] for c, where in literals.items() if c not in CATALOG and c not in NOT_CODES}
    assert unknown == {}, "add these to protocol/error_catalog.py (or to NOT_CODES if they are not codes)"
    assert sorted(c for c in _dotless_reasons() if c not in CATALOG) == []


def test_no_code_is_assembled_from_pieces() -> None:
    """A code built by an f-string or `+` escapes both the scan and the docs: use a table of literals instead."""
    families = {c.split(".", 1)[0] + "." for c in CATALOG if "." in c}
    built: list[str] = []
    for path, tree in _modules():
        for n in ast.walk(tree):
            if not isinstance(n, ast.expr):
                continue
            head: object = None
            if isinstance(n, ast.JoinedStr) and n.values and isinstance(n.values[0], ast.Constant):
                head = n.values[0].value
            elif isinstance(n, ast.BinOp) and isinstance(n.op, ast.Add) and isinstance(n.left, ast.Constant):
                head = n.left.value
            if not isinstance(head, str) or not re.match(r"^[a-z_]+\.", head):
                continue
            prefix = head.split(".", 1)[0] + "."
            if prefix in families and prefix not in NOT_CODE_PREFIXES:
                built.append(f"{path.relative_to(ROOT)}:{n.lineno}: {ast.unparse(n)}")
    assert built == []


def test_every_catalogued_code_is_emitted_somewhere_in_src() -> None:
    """No dead entries: each code is a literal in src/ (or a dotless failure reason)."""
    emitted = set(_literals()) | _dotless_reasons()
    assert sorted(c for c in CATALOG if c not in emitted) == []


def test_raise_sites_that_state_a_status_or_layer_state_the_catalogs() -> None:
    wrong: list[str] = []
    for path, tree in _modules():
        for n in ast.walk(tree):
            if not isinstance(n, ast.Call) or _name(n) not in CODE_BUILDERS:
                continue
            kw = {k.arg: k.value for k in n.keywords}
            code = kw.get("code", n.args[0] if n.args else None)
            if not isinstance(code, ast.Constant) or code.value not in CATALOG:
                continue  # passed through (the runtime guard checks those) or unknown (the literal scan fails)
            info = CATALOG[code.value]
            fixed, layer_default, takes_layer = CODE_BUILDERS[_name(n) or ""]
            status_node = kw.get("status", n.args[4] if len(n.args) > 4 else None)
            status = fixed if fixed is not None else getattr(status_node, "value", None)
            layer_node = kw.get("layer", n.args[2] if takes_layer and len(n.args) > 2 else None)
            layer = layer_default if layer_node is None else getattr(layer_node, "value", None)
            where = f"{path.relative_to(ROOT)}:{n.lineno}: {code.value}"
            if isinstance(status, int) and info.status is not None and status != info.status:
                wrong.append(f"{where} HTTP {status}, catalog {info.status}")
            if isinstance(layer, str) and layer != info.layer and code.value not in LAYER_VARIES:
                wrong.append(f"{where} layer {layer}, catalog {info.layer}")
    assert wrong == []


def test_the_catalog_is_well_formed() -> None:
    codes = [c.code for c in CODES]
    assert len(codes) == len(set(codes)), "a code is listed twice"
    assert len(codes) > 250
    layers = {layer.value for layer in Layer} | {"api", "cubelet", "scheduler", "agent", "workload"}
    for c in CODES:
        assert c.layer in layers, c
        assert c.status is None or 400 <= c.status <= 599, c
        assert c.meaning and "\n" not in c.meaning and len(c.meaning) <= 110, c


def test_the_agents_library_codes_cover_every_layer_a_contract_may_name() -> None:
    assert set(LIBRARY_MISSING) == set(agent_spec._LAYERS)
    assert all(code in CATALOG for code in LIBRARY_MISSING.values())


def test_the_catalog_is_stdlib_only_so_the_guest_agent_can_import_it() -> None:
    """protocol/errors.py imports the catalog, and the agent (stdlib-only, copied into the guest) imports errors."""
    for mod in ("error_catalog", "errors"):
        tree = ast.parse((SRC / "protocol" / f"{mod}.py").read_text())
        for n in ast.walk(tree):
            names = [a.name for a in n.names] if isinstance(n, ast.Import) else []
            if isinstance(n, ast.ImportFrom):
                names = [n.module or ""]
            for name in names:
                top = name.split(".")[0]
                assert top in sys.stdlib_module_names or name.startswith("cubeaccel.protocol") or top == "__future__", (
                    mod,
                    name,
                )


# ---- runtime guard ----


def test_the_runtime_guard_reports_an_uncatalogued_code_and_a_wrong_status() -> None:
    seen: list[str] = []
    previous = error_catalog.set_observer(seen.append)
    try:
        CubeError("nosuch.code", "m")
        ContractViolation(Layer.BACKEND, "compat.nosuch", "x", "y")
        CubeError("device.not_found", "m", "api", {}, 500)
        CubeError("device.not_found", "m", "api", {}, 404)  # right status: nothing to report
        CubeError("api.http_error", "m", "api", {}, 418)  # status varies: any is right
    finally:
        error_catalog.set_observer(previous)
    assert len(seen) == 3
    assert "'nosuch.code' is not in" in seen[0] and "'compat.nosuch' is not in" in seen[1]
    assert "carries HTTP 500, the catalog says 404" in seen[2]


@pytest.mark.uncatalogued_codes
def test_the_fixture_fails_a_test_that_builds_an_uncatalogued_code(catalogued_error_codes: list[str]) -> None:
    CubeError("nosuch.code", "m")
    assert catalogued_error_codes == ["error code 'nosuch.code' is not in cubeaccel.protocol.error_catalog"]


def test_an_omitted_status_comes_from_the_catalog() -> None:
    assert CubeError("device.not_found", "m").status == 404
    assert CubeError("cubelet.unreachable", "m").status == 502
    assert CubeError("shim.stop_requested", "m").status == 400  # no HTTP status: the old default


def test_the_api_edge_answers_with_the_catalogs_status() -> None:
    from cubeaccel.transport.api_edges import error_response

    assert error_response(CubeError("template.not_found", "m", "template")).status_code == 404
    assert error_response(CubeError("api.http_error", "m", "api", {}, 418)).status_code == 418


# ---- docs ----

BEGIN, END = "<!-- BEGIN error-catalog", "<!-- END error-catalog -->"


def test_the_error_table_in_api_md_is_generated_from_the_catalog() -> None:
    doc = (ROOT / "docs" / "api.md").read_text()
    start = doc.index("\n", doc.index(BEGIN)) + 1
    body = doc[start : doc.index(END)]
    assert body == error_catalog.markdown(), "run: python scripts/error-table.py"


def test_the_markdown_command_prints_the_table() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "cubeaccel.protocol.error_catalog", "--markdown"],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(ROOT / "src")},
    ).stdout
    assert out == error_catalog.markdown()
    assert "| `host.not_ready` | 409 | host_hardware |" in out


def test_the_agent_imports_from_the_guest_packages_alone_with_no_site_packages(tmp_path: Path) -> None:
    """What the guest image holds (images/rootfs.py `install_agent`, GUEST_SOURCE_PACKAGES), stdlib only."""
    from cubeaccel.images.rootfs import install_agent

    install_agent(tmp_path, SRC)
    home = tmp_path / "opt" / "cubeaccel"
    script = "import sys; sys.path.insert(0, sys.argv[1]); import cubeaccel.agent.__main__"
    proc = subprocess.run(
        [sys.executable, "-I", "-S", "-c", script, str(home)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
