"""The release rules on the VFIO backend over a fake sysfs tree, with real processes in the real /proc.

The "VMM" is a real process carrying the sandbox's VMM tag on its command line and holding the device's VFIO
group file open; the "shim" is a real process with the shim's argv. Cubelet finds both exactly as it finds a real
shim and QEMU (`ProcessShimDriver.status`: /proc by argv). Reports are handed to Cubelet as the shim would send
them, so the test decides what the shim *says* while the host shows what is *true*.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cubeaccel.backends.vfio import VfioBackend
from cubeaccel.cubelet import host_ready
from cubeaccel.cubelet.inventory import initialize_host
from cubeaccel.cubelet.lifecycle import Cubelet, CubeletConfig, ReservationRequest
from cubeaccel.cubelet.process_shim import ProcessShimDriver
from cubeaccel.cubelet.runtime import assemble
from cubeaccel.cubelet.scrub import SimulatedScrubRunner
from cubeaccel.cubelet.store import Store
from cubeaccel.host.pci.readiness import HostRoots
from cubeaccel.model.states import DeviceState
from cubeaccel.protocol.errors import CubeError
from cubeaccel.protocol.reports import GuestPciDevice, GuestReport, ShimReport, ShimReportKind
from cubeaccel.wire.shim_spec import ShimSpec
from tests.support.cubelet_harness import Clock
from tests.support.fake_sysfs import Dev, FakeSysfs
from tests.support.holder_proc import unreadable_pids

S, K = DeviceState, ShimReportKind
GPU = "0000:3b:00.0"

# A stand-in VMM: holds the files named on its command line until it reads "close", then lives on until killed.
_VMM = """
import sys
handles = [open(p, "rb") for p in sys.argv[1:] if p.startswith("/")]
print("ready", flush=True)
if sys.stdin.readline().strip() == "close":
    for h in handles:
        h.close()
    print("closed", flush=True)
sys.stdin.read()
"""
_SHIM = "import sys; sys.stdin.read()"


class StandInShims(ProcessShimDriver):
    """ProcessShimDriver's host-side liveness (find_shim/find_vmm in /proc), with stand-in processes started."""

    def __init__(self, state_dir: Path, group_files: list[str]) -> None:
        super().__init__(state_dir)
        self.started: dict[str, tuple[subprocess.Popen[str], subprocess.Popen[str]]] = {}
        self.group_files = group_files

    def start(self, spec: ShimSpec) -> None:
        sid = spec.sandbox_id
        own = self.dir / sid  # like the real ones: their spec and sockets lie under this Cubelet's shims/ dir
        shim = subprocess.Popen(
            [sys.executable, "-c", _SHIM, "shim", "run", "--sandbox", sid, "--spec", f"{self.dir}/{sid}.json"],
            stdin=subprocess.PIPE,
            text=True,
        )
        vmm = subprocess.Popen(
            [sys.executable, "-c", _VMM, f"guest=cubeaccel-sandbox={sid}", f"qmp={own}/qmp.sock", *self.group_files],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert vmm.stdout is not None and vmm.stdout.readline().strip() == "ready"
        self.started[sid] = (shim, vmm)

    def stop(self, sandbox_id: str) -> None:
        """The orderly request reaches the shim; what it does next is the test's to script."""

    def kill(self, sandbox_id: str) -> None:
        for p in self.started.get(sandbox_id, ()):
            p.kill()
            p.wait(timeout=10)

    def detach(self, sandbox_id: str) -> None:
        """device_del completed: the VMM closes the device's files but keeps running."""
        vmm = self.started[sandbox_id][1]
        assert vmm.stdin is not None and vmm.stdout is not None
        vmm.stdin.write("close\n")
        vmm.stdin.flush()
        assert vmm.stdout.readline().strip() == "closed"

    def end_vmm(self, sandbox_id: str) -> None:
        vmm = self.started[sandbox_id][1]
        vmm.kill()
        vmm.wait(timeout=10)

    def end_shim(self, sandbox_id: str) -> None:
        shim = self.started[sandbox_id][0]
        shim.kill()
        shim.wait(timeout=10)

    def cleanup(self) -> None:
        for sid in list(self.started):
            self.kill(sid)


@dataclass
class VfioNode:
    fake: FakeSysfs
    clock: Clock
    shims: StandInShims
    cubelet: Cubelet
    sid: str

    def report(self, kind: ShimReportKind, **details: Any) -> None:
        res = self.cubelet.store.reservation(self.sid)
        start_id = res.checkpoint.start_id if res else None
        dev_ids = tuple(res.device_ids) if res else ()
        self.cubelet.handle_report(ShimReport(self.sid, kind, dev_ids, details, 0.0, start_id))

    def state(self) -> DeviceState:
        d = self.cubelet.store.device(f"vfio-{GPU}")
        assert d is not None
        return d.state

    def reasons(self, kind: str) -> list[str | None]:
        return [e.reason for e in self.cubelet.store.events(0, 10000, sandbox_id=self.sid) if e.kind == kind]

    def running(self) -> None:
        self.cubelet.reserve(self.sid, ReservationRequest(count=1))
        self.cubelet.start(self.sid)
        self.report(K.VM_STARTED, pid=self.shims.started[self.sid][1].pid)
        self.report(K.GUEST_READY)
        self.report(K.DEVICE_ATTACHED, guest_address="0000:01:00.0")
        res = self.cubelet.store.reservation(self.sid)
        assert res is not None and res.phase == "starting"  # attached is not ready: validation comes first
        guest = GuestReport(
            1,
            "6.1.0",
            pci_devices=(GuestPciDevice("0000:01:00.0", "10de", "2331", "0302"),),
        )
        self.report(K.GUEST_VALIDATED, report=guest.to_json())
        assert self.state() is S.ATTACHED
        res = self.cubelet.store.reservation(self.sid)
        assert res is not None and res.phase == "running"


@pytest.fixture
def vfio(tmp_path: Path) -> Iterator[VfioNode]:
    fake = FakeSysfs.build(tmp_path / "fake", [Dev(GPU, iommu_group=7, driver="vfio-pci")])
    dev = Path(os.path.realpath(fake.dev))
    (dev / "vfio").mkdir(exist_ok=True)
    group = dev / "vfio" / "7"
    group.write_text("")
    host = fake.host()
    host.proc_root, host.dev_root, host.exempt_pids = Path("/proc"), dev, unreadable_pids()
    clock = Clock()
    (tmp_path / "state").mkdir()
    shims = StandInShims(tmp_path / "state", [str(group)])
    backend = VfioBackend(host, readiness_roots=HostRoots(fake.sys, dev, fake.proc))
    cubelet = assemble(
        Store(tmp_path / "cubelet.db", clock=clock),
        backend,
        shims,
        # stand-in shim and VMM processes (unconfined): Cubelet's confinement gate has its own tests
        # (tests/host/test_cubelet_confinement_gate.py, tests/vm/test_confined_vmm.py); these are about release
        CubeletConfig(release_timeout_s=10, kill_grace_s=5, pinnable_memory_mib=1 << 20, require_vmm_confinement=False),
        scrub_runner=SimulatedScrubRunner(),  # stand-in shims: the scrub VM is stood in too (tests/vm runs one)
    )
    initialize_host(cubelet)
    node = VfioNode(fake, clock, shims, cubelet, f"rr-{uuid.uuid4().hex[:12]}")
    assert node.state() is S.ALLOCATABLE
    try:
        yield node
    finally:
        shims.cleanup()
        cubelet.store.close()


def test_detach_confirmed_while_the_vmm_lives_keeps_the_device_releasing(vfio: VfioNode) -> None:
    vfio.running()
    vfio.cubelet.release(vfio.sid)
    vfio.shims.detach(vfio.sid)
    vfio.report(K.DEVICE_DETACHED)
    vfio.cubelet.try_release(vfio.sid)
    assert vfio.state() is S.RELEASING  # no holder of the group file any more, but the VMM lives
    assert vfio.reasons("release_waiting") == ["release.vmm_not_exited"]
    with pytest.raises(CubeError) as refused:
        vfio.cubelet.reserve(f"{vfio.sid}-next", ReservationRequest(count=1))
    assert refused.value.code == "reserve.insufficient_devices"
    vfio.shims.end_vmm(vfio.sid)
    vfio.report(K.VMM_EXITED)
    vfio.cubelet.try_release(vfio.sid)
    assert vfio.state() is S.RELEASING  # the shim is alive and has not sent its final report
    vfio.report(K.SHIM_EXITING)
    vfio.cubelet.try_release(vfio.sid)
    assert vfio.state() is S.ALLOCATABLE
    assert vfio.fake.resets.get(GPU) == 2  # after the tenant's VMM, and again after the scrub VM
    confirmed = [e for e in vfio.cubelet.store.events(0, 10000, sandbox_id=vfio.sid) if e.event == "release_confirmed"]
    assert confirmed[-1].details == {
        "vmm_exited": True,
        "shim_exited": False,
        "shim_final_report": True,
        "detach_confirmed": True,
        "holders": 0,
        "reset": True,
        # a clean exit (the shim's final report): rung 1 did it
        "reset_ladder": [
            {"rung": "function", "reason": "the function's own reset", "methods": ["flr"], "check": [], "ok": True}
        ],
        "scrub_owed": True,
        "scrub_policy": "trusted-vm",
        "scrub_method": "cuda",  # the registry's (backends/scrub_methods.py), recorded with the release
        "vmm_started": True,
    }
    assert vfio.cubelet.store.reservation(vfio.sid) is None


def test_the_shims_final_report_releases_at_once_without_a_reconcile_pass(vfio: VfioNode) -> None:
    vfio.running()
    vfio.cubelet.release(vfio.sid)
    vfio.shims.detach(vfio.sid)
    vfio.report(K.DEVICE_DETACHED)
    vfio.shims.end_vmm(vfio.sid)
    vfio.report(K.VMM_EXITED)
    assert vfio.state() is S.RELEASING  # the shim lives and has not said it is done
    vfio.report(K.SHIM_EXITING)  # and nothing else: no try_release, no reconcile pass
    assert vfio.state() is S.ALLOCATABLE
    assert vfio.cubelet.store.reservation(vfio.sid) is None


def test_vmm_exit_and_shim_exit_release_without_any_report(vfio: VfioNode) -> None:
    vfio.running()
    vfio.cubelet.release(vfio.sid)
    vfio.shims.end_vmm(vfio.sid)
    vfio.cubelet.try_release(vfio.sid)
    assert vfio.state() is S.RELEASING
    vfio.shims.end_shim(vfio.sid)
    vfio.cubelet.try_release(vfio.sid)
    assert vfio.state() is S.ALLOCATABLE
    # no final report: an unclean exit, so this NVIDIA GPU would start at the bus rung (backends/nvidia.py); on a
    # root bus there is none, and its FLR ran instead, saying why
    confirmed = [e for e in vfio.cubelet.store.events(0, 10000, sandbox_id=vfio.sid) if e.event == "release_confirmed"]
    (attempt,) = confirmed[0].details["reset_ladder"]
    assert (attempt["rung"], attempt["ok"]) == ("function", True) and "root bus" in attempt["reason"]


def test_an_unreadable_fd_dir_is_an_unknown_holder_quarantined_after_the_timeout(
    vfio: VfioNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    vfio.running()
    bystander = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        real_scandir = os.scandir

        def scandir(path: Any) -> Any:
            if str(path) == f"/proc/{bystander.pid}/fd":
                raise PermissionError(13, "Permission denied", str(path))
            return real_scandir(path)

        monkeypatch.setattr(os, "scandir", scandir)
        vfio.cubelet.release(vfio.sid)
        vfio.shims.kill(vfio.sid)
        vfio.cubelet.try_release(vfio.sid)
        assert vfio.state() is S.RELEASING
        assert vfio.reasons("release_waiting") == ["release.vmm_not_exited", "release.holder_unknown"]
        vfio.clock.advance(11)
        vfio.cubelet.try_release(vfio.sid)
        d = vfio.cubelet.store.device(f"vfio-{GPU}")
        assert d is not None and d.state is S.QUARANTINED and d.reason == "release.holder_unknown"
        assert vfio.fake.resets.get(GPU) is None  # never reset while someone may hold it
        assert vfio.cubelet.store.reservation(vfio.sid) is None  # the VMM is gone: nothing left to track
    finally:
        bystander.kill()
        bystander.wait(timeout=10)


def test_a_release_on_a_host_that_stopped_being_ready_gives_nothing_back(vfio: VfioNode) -> None:
    vfio.running()
    params = vfio.fake.sys / "module" / "vfio_iommu_type1" / "parameters"
    params.mkdir(parents=True, exist_ok=True)
    (params / "allow_unsafe_interrupts").write_text("Y\n")  # an operator turned interrupt isolation off
    assert not host_ready.check(vfio.cubelet).ready
    vfio.cubelet.release(vfio.sid)
    vfio.shims.kill(vfio.sid)
    vfio.cubelet.try_release(vfio.sid)
    d = vfio.cubelet.store.device(f"vfio-{GPU}")
    assert d is not None and (d.state, d.reason) == (S.INITIALIZED, "host.unsafe_interrupts")
    trail = [e.event for e in vfio.cubelet.store.events(0, 10000, d.id) if e.kind == "transition"]
    assert trail[-3:] == ["release_confirmed", "revalidated", "host_not_ready"]


def test_a_group_node_handed_to_the_vmm_uid_is_taken_back_before_the_device_returns(vfio: VfioNode) -> None:
    group = vfio.fake.dev.resolve() / "vfio" / "7"
    vfio.running()
    os.chown(group, 1_900_000_123, 1_900_000_123)  # what the shim did for the sandbox's VMM (host/vmm/confine.py)
    os.chmod(group, 0o660)
    vfio.cubelet.release(vfio.sid)
    vfio.shims.kill(vfio.sid)
    vfio.cubelet.try_release(vfio.sid)
    assert vfio.state() is S.ALLOCATABLE
    st = group.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (0, 0, 0o600)


def test_a_group_node_that_cannot_be_taken_back_quarantines_the_device(
    vfio: VfioNode, monkeypatch: pytest.MonkeyPatch
) -> None:

    group = vfio.fake.dev.resolve() / "vfio" / "7"
    vfio.running()
    os.chown(group, 1_900_000_123, 1_900_000_123)

    def refuse(path: Any, uid: int, gid: int) -> None:
        raise PermissionError(1, "Operation not permitted", str(path))

    monkeypatch.setattr(os, "chown", refuse)  # as host/vmm/confine.py calls it
    vfio.cubelet.release(vfio.sid)
    vfio.shims.kill(vfio.sid)
    vfio.cubelet.try_release(vfio.sid)
    assert vfio.state() is S.QUARANTINED  # the last tenant's uid could still open it: never handed on
    d = vfio.cubelet.store.device(f"vfio-{GPU}")
    assert d is not None and d.reason == "release.device_node_not_returned"
    assert vfio.fake.resets.get(GPU) is None  # quarantined before any reset: nothing else ran on it
