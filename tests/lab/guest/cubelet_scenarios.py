"""The Cubelet itself in the lab guest: reserve → start → attach → release → revalidate through the real kernel.

Real: the Cubelet (lifecycle, release rules, SQLite store), VfioBackend + SysfsPciHost on the guest's /sys,
ProcessShimDriver's liveness (the VMM found in /proc by its sandbox tag), and a real QEMU that hot-plugs the device
over QMP and holds it through VFIO. Stood in: the shim process (argv only) and its reports, which the scenario
sends as the shim would (the L2 guest never runs, so its validation report is written here). One deviation from a
production host: `virtualization` (no /dev/kvm under TCG) is not a readiness failure here; the VMM runs TCG.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import procs
from scenarios import EDU, RP, ensure_vfio, fn, holders
from vmm_scenarios import Vmm, refused_open, start_vmm

from cubeaccel.backends.base import Problem
from cubeaccel.backends.vfio import VfioBackend
from cubeaccel.cubelet.inventory import initialize_host
from cubeaccel.cubelet.lifecycle import CubeletConfig, ReservationRequest
from cubeaccel.cubelet.process_shim import ProcessShimDriver
from cubeaccel.cubelet.reconcile import reconcile
from cubeaccel.cubelet.runtime import assemble
from cubeaccel.cubelet.scrub import SimulatedScrubRunner
from cubeaccel.cubelet.shim_driver import NodeFacts
from cubeaccel.cubelet.store import Store
from cubeaccel.host.pci.readiness import HostRoots
from cubeaccel.host.pci.sysfs import SysfsPciHost
from cubeaccel.model.node_facts import HOTPLUG_PCIE_ROOT_PORT_ACPI
from cubeaccel.protocol.errors import CubeError
from cubeaccel.protocol.reports import GuestPciDevice, GuestReport, ShimReport, ShimReportKind
from cubeaccel.wire.shim_spec import ShimSpec

K = ShimReportKind
# The lab guest locks 1 GiB; a sandbox is charged its guest and the measured VMM overhead (model/pinned_memory.py:
# 624 MiB at one vCPU), so the lab's sandboxes are 256 MiB guests.
LAB_GUEST_MIB = 256


class TcgLabBackend(VfioBackend):
    def readiness(self) -> list[Problem]:
        return [p for p in super().readiness() if p.code != "host.no_kvm"]


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class LabShims(ProcessShimDriver):
    """ProcessShimDriver's host-side liveness, with a stand-in shim and a real QEMU that hot-plugs the device."""

    def __init__(self, state_dir: Path) -> None:
        super().__init__(state_dir)
        self.started: dict[str, tuple[subprocess.Popen[bytes], Vmm]] = {}

    def node_facts(self) -> NodeFacts:
        return NodeFacts((), (HOTPLUG_PCIE_ROOT_PORT_ACPI,))

    def start(self, spec: ShimSpec) -> None:
        sid = spec.sandbox_id
        shim = subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.stdin.read()", "shim", "run", "--sandbox", sid, "--spec",
             f"{self.dir}/{sid}.json"],
            stdin=subprocess.PIPE,
        )  # fmt: skip
        (self.dir / sid).mkdir(exist_ok=True)
        vmm = start_vmm(sid, [], qmp_dir=str(self.dir / sid))
        assert vmm.qmp is not None
        for i, d in enumerate(spec.devices):
            reply = vmm.qmp.cmd("device_add", driver=d.driver, id=f"gpu{i}", bus="rp1", **d.properties)
            assert "return" in reply, reply
        self.started[sid] = (shim, vmm)

    def stop(self, sandbox_id: str) -> None:
        """The orderly request reaches the shim; what happens next is the scenario's to script."""

    def kill(self, sandbox_id: str) -> None:
        shim, vmm = self.started[sandbox_id]
        shim.kill()
        shim.wait()
        vmm.proc.kill()
        vmm.proc.wait()


def cubelet_cycle() -> dict[str, Any]:
    ensure_vfio(RP)
    out: dict[str, Any] = {}
    work = Path(tempfile.mkdtemp(prefix="cubelet-", dir="/tmp"))
    clock = Clock()
    host = SysfsPciHost()
    backend = TcgLabBackend(host, allow=[f"{EDU}@{RP}"], readiness_roots=HostRoots())
    shims = LabShims(work)
    cubelet = assemble(
        Store(work / "cubelet.db", clock=clock),
        backend,
        shims,
        # the stand-in shim starts QEMU itself, unconfined: Cubelet's confinement gate is tested in tests/host and
        # tests/vm (test_cubelet_confinement_gate.py, test_confined_vmm.py), the VFIO path here
        CubeletConfig(release_timeout_s=30, kill_grace_s=5, pinnable_memory_mib=1024, require_vmm_confinement=False),
        scrub_runner=SimulatedScrubRunner(),  # stand-in shims: the scrub VM is stood in too (tests/vm runs one)
    )
    initialize_host(cubelet)
    dev_id = f"vfio-{RP}"
    sid = f"lab-{uuid.uuid4().hex[:8]}"

    def state() -> str:
        d = cubelet.store.device(dev_id)
        return d.state.value if d else "missing"

    def report(kind: ShimReportKind, **details: Any) -> None:
        res = cubelet.store.reservation(sid)
        start_id = res.checkpoint.start_id if res else None
        cubelet.handle_report(ShimReport(sid, kind, tuple(res.device_ids) if res else (), details, 0.0, start_id))

    def waits() -> list[str | None]:
        return [e.reason for e in cubelet.store.events(0, 10000, sandbox_id=sid) if e.kind == "release_waiting"]

    try:
        out["initial"] = state()
        t0 = time.monotonic()
        cubelet.reserve(sid, ReservationRequest(count=1, memory_mib=LAB_GUEST_MIB))
        cubelet.start(sid)
        out["start_ms"] = round((time.monotonic() - t0) * 1000)
        shim, vmm = shims.started[sid]
        report(K.VM_STARTED, pid=vmm.pid)
        report(K.GUEST_READY)
        report(K.DEVICE_ATTACHED, guest_address="0000:01:00.0")
        guest = GuestReport(1, "6.1.0", pci_devices=(GuestPciDevice("0000:01:00.0", "1234", "11e8", "00ff"),))
        report(K.GUEST_VALIDATED, report=guest.to_json())
        out["attached"] = state()
        out["holders_attached"] = holders(RP)
        out["vmm_pid"] = vmm.pid
        out["repairs"] = [str(r) for r in reconcile(cubelet)]
        out["after_reconcile"] = state()

        cubelet.release(sid)
        cubelet.try_release(sid)
        out["releasing_vmm_alive"] = state()
        try:
            cubelet.reserve(f"{sid}-next", ReservationRequest(count=1, memory_mib=LAB_GUEST_MIB))
            out["reserve_while_releasing"] = "granted"
        except CubeError as e:
            out["reserve_while_releasing"] = e.code
        out["second_vmm"] = refused_open(RP)

        vmm.quit()  # the VMM exits; a process it left behind keeps only the device fd (its group fd closed)
        straggler = procs.spawn_holder(str(RP), fn(RP).iommu_group or -1, device_fd_only=True)
        shim.kill()
        shim.wait()
        cubelet.try_release(sid)
        out["releasing_straggler"] = state()
        straggler.stop()
        cubelet.try_release(sid)
        out["released"] = state()
        out["waits"] = waits()
        confirmed = [e for e in cubelet.store.events(0, 10000, sandbox_id=sid) if e.event == "release_confirmed"]
        out["evidence"] = confirmed[-1].details if confirmed else None
        out["reservation_closed"] = cubelet.store.reservation(sid) is None
        out["cycle_ms"] = round((time.monotonic() - t0) * 1000)
    finally:
        for p, v in shims.started.values():
            p.kill()
            v.proc.kill()
        cubelet.store.close()
    return out


SCENARIOS = {"cubelet_cycle": cubelet_cycle}
