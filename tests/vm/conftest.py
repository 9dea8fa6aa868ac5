"""Real QEMU MicroVMs: the guest image is built (or reused from the cache) once per session.

Every VMM a test starts is tagged with its sandbox id; teardown finds them by tag (`find_vmm`) and kills them,
so a failing test never leaves QEMU running. Skipped only where QEMU itself is missing.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from cubeaccel.host.vmmproc import find_vmm
from cubeaccel.images.builder import build
from cubeaccel.images.manifest import Manifest

pytestmark = pytest.mark.vm
_STARTED: list[str] = []


def _kill_tagged() -> None:
    """Every VMM this session may have left: the shims' and the template builders' (tag `template-*`)."""
    from cubeaccel.host.vmmproc import vmm_processes

    pids = {find_vmm(sandbox) for sandbox in _STARTED}
    pids |= {p.pid for p in vmm_processes() if p.sandbox_id.startswith("template-")}
    for pid in pids - {None}:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # type: ignore[arg-type]


atexit.register(_kill_tagged)


@pytest.fixture(scope="session")
def guest_image() -> Manifest:
    if shutil.which("qemu-system-x86_64") is None:
        if os.environ.get("CUBEACCEL_REQUIRE_VM"):
            pytest.fail("qemu-system-x86_64 missing but CUBEACCEL_REQUIRE_VM is set (CI must run the VM tests)")
        pytest.skip("qemu-system-x86_64 missing: run scripts/install-system-deps.sh")
    manifest, _ = build()
    return manifest


@dataclass
class ShimRun:
    """One `cubeaccel shim run` process and the reports it appends to a file."""

    sandbox_id: str
    spec_path: Path
    reports_path: Path
    state_dir: Path
    proc: subprocess.Popen[bytes] | None = None
    _seen: list[dict[str, Any]] = field(default_factory=list)

    def start(self, wrapper: tuple[str, ...] = ()) -> ShimRun:
        cmd = [*wrapper, sys.executable, "-c", "from cubeaccel.cli import main; main()",
               "shim", "run", "--sandbox", self.sandbox_id, "--spec", str(self.spec_path)]
        with (self.state_dir.parent / "shim.log").open("ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=log)
        return self

    def reports(self) -> list[dict[str, Any]]:
        if not self.reports_path.exists():
            return []
        return [json.loads(line) for line in self.reports_path.read_text().splitlines() if line.strip()]

    def kinds(self) -> list[str]:
        return [r["kind"] for r in self.reports()]

    def wait_for(self, kind: str, timeout_s: float = 90.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for r in self.reports():
                if r["kind"] == kind:
                    return r
            if kind != "shim_exiting" and "shim_exiting" in self.kinds():
                break
            time.sleep(0.05)
        raise AssertionError(f"no {kind} report; got {self.kinds()}\n{self.log_tail()}")

    def one(self, kind: str) -> dict[str, Any]:
        found = [r for r in self.reports() if r["kind"] == kind]
        assert len(found) == 1, f"{kind}: {len(found)} reports in {self.kinds()}"
        return found[0]

    def terminate(self, timeout_s: float = 60.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)

    def log_tail(self) -> str:
        parts = []
        for p in (self.state_dir.parent / "shim.log", self.state_dir / "vmm.log", self.state_dir / "console.log"):
            if p.exists():
                parts.append(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}")
        return "\n".join(parts)


@pytest.fixture
def shim_factory(tmp_path: Path, guest_image: Manifest) -> Iterator[Any]:
    runs: list[ShimRun] = []

    def make(start: str = "template", devices: int = 1, pin_memory: bool = True, contract: dict[str, Any] | None = None,
             detach_timeout_s: float = 5.0, report: dict[str, str] | None = None, memory_mib: int = 256,
             explicit_image: bool = True, memory_backend: str = "ram",
             device: dict[str, Any] | None = None) -> ShimRun:
        sandbox = f"t-{uuid.uuid4().hex[:10]}"
        base = tmp_path / sandbox
        base.mkdir()
        spec = {
            "sandbox_id": sandbox,
            "devices": [device or {"device_id": f"emulated-0000:e0:{i:02x}.0", "driver": "edu", "properties": {},
                                   "vendor_id": "1234", "device_id_hex": "11e8"} for i in range(devices)],
            "memory_mib": memory_mib, "vcpus": 1, "pin_memory": pin_memory, "contract": contract,
            "image_manifest": str(guest_image.directory / "manifest.json") if explicit_image else None,
            "image_digest": None if explicit_image else guest_image.image_digest,  # else: found in the cache
            "start": start,
            "state_dir": str(base / "state"), "report": report or {"file": str(base / "reports.jsonl")},
            "detach_timeout_s": detach_timeout_s, "memory_backend": memory_backend,
        }
        (base / "spec.json").write_text(json.dumps(spec))
        run = ShimRun(sandbox, base / "spec.json", base / "reports.jsonl", base / "state")
        runs.append(run)
        _STARTED.append(sandbox)
        return run

    yield make
    for run in runs:
        if run.proc is not None and run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()
    _kill_tagged()
