"""Real QEMU MicroVMs: the guest image is built (or reused from the shared cache) once, then used from a
per-run cache.

Shared-host rules (other test runs, other worktrees, an operator's Cubelet may run here at the same time):
- the run's cache (`CUBEACCEL_CACHE_DIR`, set for this process and every shim and Cubelet it starts) is its own:
  the image is hard-linked (or copied) out of the shared cache under the builder's lock, so another run's build
  that prunes the shared cache never removes it, and template states are built and pruned per run;
- device ids carry this run's instance id (`RUN_INSTANCE`), as an emulated Cubelet's carry its own;
- teardown stops only the VMMs this run started, by the pid files in directories it owns (`tests.support.vmm_cleanup`).
Skipped only where QEMU itself is missing.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from cubeaccel.backends.emulated import slot_address
from cubeaccel.images.builder import build, cache_dir, image_label
from cubeaccel.images.flavour import VALIDATION, Flavour
from cubeaccel.images.manifest import Manifest
from cubeaccel.images.vendor import VendorStack
from cubeaccel.model.device import device_id_for
from tests.support.poll import poll
from tests.support.vmm_cleanup import kill_started_vmms

pytestmark = pytest.mark.vm
RUN_INSTANCE = uuid.uuid4().hex[:8]
SHARED_CACHE = cache_dir()  # read before the session points CUBEACCEL_CACHE_DIR at its own cache


def emulated_id(index: int) -> str:
    """This run's emulated device id for slot `index` (what shims tag their VMMs with)."""
    return device_id_for("emulated", slot_address(index), RUN_INSTANCE)


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)  # images are immutable once renamed into place: a hard link is a private copy
    except OSError:
        shutil.copy2(src, dst)


def private_image(
    shared: Path, run_cache: Path, stack: VendorStack | None = None, flavour: Flavour = VALIDATION
) -> Manifest:
    """Build (or reuse) the image in the shared cache, then take this run's own copy of it under the builder's
    lock (a concurrent build prunes only after it holds that lock, so the files are all there while we link)."""
    for _ in range(3):
        m, _built = build(shared, stack=stack, flavour=flavour)
        with (shared / "images" / ".lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            files = [p for p in m.directory.iterdir() if p.is_file()] if m.directory.is_dir() else []
            if not (m.directory / "manifest.json").exists() or any(
                not m.path(a).exists() for a in (m.vmlinux, m.initrd, m.modules_img)
            ):
                continue  # pruned between build() and the lock: build again
            mine = run_cache / "images" / m.key
            mine.mkdir(parents=True, exist_ok=True)  # another suite's session fixture (tests/e2b) took it already
            for f in files:
                if not (mine / f.name).exists():  # images are immutable by key: a copy taken is the same bytes
                    _link_or_copy(f, mine / f.name)
        label = image_label(flavour, stack)
        (run_cache / "images" / (f"latest-{label}" if label else "latest")).write_text(m.key + "\n")
        return Manifest.load(mine / "manifest.json")
    raise AssertionError(f"the image in {shared} kept being pruned by concurrent builds")


@pytest.fixture(scope="session")
def guest_image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Manifest]:
    if shutil.which("qemu-system-x86_64") is None:
        if os.environ.get("CUBEACCEL_REQUIRE_VM"):
            pytest.fail("qemu-system-x86_64 missing but CUBEACCEL_REQUIRE_VM is set (CI must run the VM tests)")
        pytest.skip("qemu-system-x86_64 missing: run scripts/install-system-deps.sh")
    base = tmp_path_factory.getbasetemp()
    atexit.register(kill_started_vmms, base)  # even when the session is torn down abnormally
    run_cache = base / "cubeaccel-cache"
    manifest = private_image(SHARED_CACHE, run_cache)
    env = pytest.MonkeyPatch()
    env.setenv("CUBEACCEL_CACHE_DIR", str(run_cache))  # inherited by every shim and Cubelet started from here
    try:
        yield manifest
    finally:
        kill_started_vmms(base)
        env.undo()
        shutil.rmtree(run_cache / "templates", ignore_errors=True)  # ~150 MB per machine shape


@pytest.fixture(scope="session")
def gpu_image(guest_image: Manifest) -> Manifest:
    """The GPU image the shipped templates pin (the userland flavour with NVIDIA's stack), built from Debian's
    packages in the shared cache (its module compile is cached there across runs: minutes cold), taken into
    this run's cache beside the CPU image."""
    from cubeaccel.images.builder import GPU_FLAVOUR, flavour_named
    from cubeaccel.images.nvidia import NVIDIA

    return private_image(SHARED_CACHE, guest_image.directory.parent.parent, NVIDIA, flavour_named(GPU_FLAVOUR))


@pytest.fixture(scope="session")
def userland_image(guest_image: Manifest) -> Manifest:
    """The userland flavour (E2B base's tools), built in the shared cache, taken into this run's cache."""
    from cubeaccel.images.userland import USERLAND

    return private_image(SHARED_CACHE, guest_image.directory.parent.parent, flavour=USERLAND)


@dataclass
class ShimRun:
    """One `cubeaccel shim run` process and the reports it appends to a file."""

    sandbox_id: str
    spec_path: Path
    reports_path: Path
    state_dir: Path
    proc: subprocess.Popen[bytes] | None = None
    workload_token: str | None = None  # given on stdin, as Cubelet does, when the spec asks for the workload bridge
    _seen: list[dict[str, Any]] = field(default_factory=list)

    def start(self, wrapper: tuple[str, ...] = ()) -> ShimRun:
        cmd = [
            *wrapper,
            sys.executable,
            "-c",
            "from cubeaccel.cli import main; main()",
            "shim",
            "run",
            "--sandbox",
            self.sandbox_id,
            "--spec",
            str(self.spec_path),
        ]
        with (self.state_dir.parent / "shim.log").open("ab") as log:
            stdin = subprocess.PIPE if self.workload_token else subprocess.DEVNULL
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=stdin)
        if self.workload_token and self.proc.stdin is not None:
            self.proc.stdin.write(self.workload_token.encode() + b"\n")
            self.proc.stdin.close()
        return self

    def reports(self) -> list[dict[str, Any]]:
        if not self.reports_path.exists():
            return []
        return [json.loads(line) for line in self.reports_path.read_text().splitlines() if line.strip()]

    def kinds(self) -> list[str]:
        return [r["kind"] for r in self.reports()]

    def wait_for(self, kind: str, timeout_s: float = 90.0) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            reports = self.reports()
            for r in reports:
                if r["kind"] == kind:
                    return r
            exited = kind != "shim_exiting" and any(r["kind"] == "shim_exiting" for r in reports)
            assert not exited, f"the shim exited before {kind}"
            return None

        try:
            return poll(found, timeout_s)
        except AssertionError as e:
            raise AssertionError(f"{e}\nno {kind} report; got {self.kinds()}\n{self.log_tail()}") from None

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


@pytest.fixture(scope="session")
def prepared_shapes(guest_image: Manifest) -> Callable[[int, str], Path]:
    """This run's host initialization: a machine shape's template snapshot, made once before the first start
    that restores it (a start never makes one: it boots cold instead)."""
    from cubeaccel.shim.template import prepare_template, shape_config

    done: dict[tuple[int, str], Path] = {}

    def prepare(memory_mib: int = 256, memory_backend: str = "ram") -> Path:
        if (memory_mib, memory_backend) not in done:
            root = cache_dir() / "templates"
            cfg = shape_config(guest_image, memory_mib, 1, root / "prepare", memory_backend)
            done[(memory_mib, memory_backend)], _ = prepare_template(cfg, guest_image, root)
        return done[(memory_mib, memory_backend)]

    return prepare


@pytest.fixture
def shim_factory(tmp_path: Path, guest_image: Manifest, prepared_shapes: Callable[[int, str], Path]) -> Iterator[Any]:
    runs: list[ShimRun] = []

    def make(
        start: str = "template",
        devices: int = 1,
        pin_memory: bool = True,
        contract: dict[str, Any] | None = None,
        detach_timeout_s: float = 5.0,
        report: dict[str, str] | None = None,
        memory_mib: int = 256,
        explicit_image: bool = True,
        memory_backend: str = "ram",
        device: dict[str, Any] | None = None,
        image: Manifest | None = None,
        prepared: bool = True,
    ) -> ShimRun:
        """`prepared`: a `template` start finds its shape's snapshot (made now if this run has none yet)."""
        if start == "template" and prepared:
            prepared_shapes(memory_mib, memory_backend)
        sandbox = f"t-{uuid.uuid4().hex[:10]}"
        base = tmp_path / sandbox
        base.mkdir()
        spec = {
            "sandbox_id": sandbox,
            "devices": [
                device
                or {
                    "device_id": emulated_id(i),
                    "driver": "edu",
                    "properties": {},
                    "vendor_id": "1234",
                    "device_id_hex": "11e8",
                }
                for i in range(devices)
            ],
            "memory_mib": memory_mib,
            "vcpus": 1,
            "pin_memory": pin_memory,
            "contract": contract,
            "image_manifest": str((image or guest_image).directory / "manifest.json") if explicit_image else None,
            "image_digest": None if explicit_image else (image or guest_image).image_digest,  # found in the cache
            "start": start,
            "state_dir": str(base / "state"),
            "report": report or {"file": str(base / "reports.jsonl")},
            "detach_timeout_s": detach_timeout_s,
            "memory_backend": memory_backend,
        }
        (base / "spec.json").write_text(json.dumps(spec))
        run = ShimRun(sandbox, base / "spec.json", base / "reports.jsonl", base / "state")
        runs.append(run)
        return run

    yield make
    for run in runs:
        if run.proc is not None and run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()
    kill_started_vmms(tmp_path)  # the shims' VMMs run in their own sessions: stopped by their pid files
