"""How Cubelet drives the VM side of a sandbox. The shim only reports; Cubelet decides.

`ShimDriver` is the interface a separate shim process is driven through (start, stop, kill,
status); reports come back to `Cubelet.handle_report` — over HTTP for the real shim, by a direct
call here. `SimulatedShimDriver` plays shim + VMM on a `SimulatedPciHost`, whose process table
survives Cubelet restarts exactly as real shim and VMM processes do.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Protocol

from cubeaccel.host.pci.base import Holder
from cubeaccel.host.pci.simulated import SimulatedPciHost
from cubeaccel.model.device import PciAddress
from cubeaccel.model.guest_checks import min_driver_api
from cubeaccel.model.node_facts import HOTPLUG_PCIE_ROOT_PORT_ACPI, GuestImageFact, pinned_image
from cubeaccel.protocol.reports import CudaInfo, GuestPciDevice, GuestReport, LibraryInfo, ShimReport
from cubeaccel.wire.reports import (
    AttachFailed,
    DetachTimeout,
    DeviceAttached,
    DeviceDetached,
    GuestReady,
    GuestValidated,
    GuestValidationFailed,
    MemoryPinned,
    ReportDetails,
    ShimExiting,
    VmmExited,
    VmStarted,
    WarmClaimed,
)
from cubeaccel.wire.shim_spec import ShimSpec
from cubeaccel.wire.warm import ShimClaim, ShimClaimAck

ReportSink = Callable[[ShimReport], None]


def guest_address(index: int) -> str:
    """Where the simulated guest sees the index-th hot-plugged device (one root port each, as the real shim)."""
    return f"0000:{index + 1:02x}:00.0"


def simulated_guest_report(spec: ShimSpec) -> GuestReport:
    """The simulated guest is exactly what its contract asks for (there is no guest to disagree): the host-side
    judge still runs over it, so a wrong contract, device or address is caught as with a real guest."""
    pci = tuple(
        GuestPciDevice(guest_address(i), f"{d.vendor_id:04x}", f"{d.device_id_hex:04x}", "0302")
        for i, d in enumerate(spec.devices)
    )
    if spec.contract is None:
        return GuestReport(agent_version=1, kernel_release="simulated", pci_devices=pci)
    t = spec.contract.template
    modules = ([t.kernel_driver.module] if t.kernel_driver else []) + list(t.probes.modules)
    libraries = {n: LibraryInfo(loaded=True) for n in t.probes.libraries}
    if t.userspace_driver:
        libraries |= {n: LibraryInfo(True, version=t.userspace_driver.version) for n in t.userspace_driver.libraries}
    need = min_driver_api(t)
    return GuestReport(
        agent_version=1,
        kernel_release=t.guest_kernel.version,
        modules_loaded=tuple(modules),
        pci_devices=pci,
        device_files={p: True for p in t.probes.device_files},
        kernel_driver_version=t.kernel_driver.version if t.kernel_driver else None,
        libraries=libraries,
        cuda=None if need is None else CudaInfo(driver_version=need, init_ok=True, device_count=len(spec.devices)),
    )


@dataclass(frozen=True)
class NodeFacts:
    """What this node's VM side can boot and attach, as the heartbeat reports it (docs/api.md)."""

    guest_images: tuple[GuestImageFact, ...]  # newest first: the first is the default for unpinned sandboxes
    hotplug: tuple[str, ...]

    @property
    def default_image(self) -> str | None:
        return self.guest_images[0].digest if self.guest_images else None


@functools.cache
def simulated_guest_images() -> tuple[GuestImageFact, ...]:
    """The simulated node's guests are exactly what the example templates pin (the CUDA one first), read from
    those files, so a simulated cluster schedules them and a re-pinned example moves the simulated node with it.
    Read on first use: a real node (and the lab guest, which has no YAML parser) never needs them."""
    from cubeaccel.wire.templates import loads_document, parse_template

    folder = resources.files("cubeaccel") / "examples" / "templates"
    return tuple(
        pinned_image(parse_template(loads_document((folder / name).read_text(), name), name))
        for name in ("cuda12-h100.yaml", "edu-demo.yaml", "base.yaml")
    )


SIMULATED_HOTPLUG = (HOTPLUG_PCIE_ROOT_PORT_ACPI,)  # the simulated VMM plays QEMU


@dataclass(frozen=True)
class ShimStatus:
    """None means "cannot tell" — the release rules treat it as unsafe."""

    shim_alive: bool | None
    vmm_alive: bool | None
    vmm_pid: int | None = None


class ShimDriver(Protocol):
    max_devices: int  # how many devices one VM can take (root ports)
    host_devices: bool  # real MicroVMs: sandbox networks and scratch disks are built on the host for them

    def bind(self, sink: ReportSink) -> None: ...

    def start(self, spec: ShimSpec) -> None: ...

    def stop(self, sandbox_id: str) -> None:
        """Orderly teardown request: detach, stop the VMM, report. Returns without waiting."""
        ...

    def kill(self, sandbox_id: str) -> None:
        """Force: SIGKILL shim and VMM. Success is only ever learned from `status`."""
        ...

    def status(self, sandbox_id: str) -> ShimStatus: ...

    def pending_reports(self, sandbox_id: str) -> list[ShimReport]:
        """Reports the shim could not deliver (Cubelet was down); each is handed over once."""
        ...

    def node_facts(self) -> NodeFacts:
        """The guest images present and the hot-plug paths of the VMM, learned from the host each call."""
        ...

    def release_files(self, sandbox_id: str) -> list[str]:
        """Remove what the sandbox's shim left that held tenant data (its scratch disk); returns what was there.
        Called by the release path once the VMM is proven gone."""
        ...

    def claim(self, shim_id: str, claim: ShimClaim, timeout_s: float) -> ShimClaimAck:
        """Hand a warm shim its claim (the tenant's workload token, an RNG seed); its answer, or a refusal."""
        ...

    @property
    def launches(self) -> dict[str, int] | None:
        """How this process's shim starts went, by how the process was made (a metric); None: not counted."""
        ...

    def workload_socket(self, sandbox_id: str) -> Path | None:
        """Where the shim bridges its guest's workload service (the Cubelet's proxy connects there); None for a
        driver whose shims run no guest to reach."""
        ...

    def retire_runs(self, open_ids: Callable[[], set[str]]) -> list[str]:
        """Move the files of every run that is over (no open reservation, no process) out of the way, keeping
        a bounded number for post-mortems (cubelet/runfiles.py); returns their ids."""
        ...


@dataclass
class SimulatedShimDriver:
    """In-process shim over the simulated host, with VM-side fault knobs per sandbox."""

    host: SimulatedPciHost
    max_devices: int = 64
    fail_attach: set[str] = field(default_factory=set)
    uncooperative_guest: set[str] = field(default_factory=set)  # never completes device_del
    immortal_vmm: set[str] = field(default_factory=set)  # SIGKILL does not take
    failed_guest_validation: set[str] = field(default_factory=set)
    slow_start: set[str] = field(default_factory=set)  # the shim runs, its VMM comes with finish_start()
    cubelet_down: set[str] = field(default_factory=set)  # reports cannot be delivered: the shim keeps them
    guest_images: tuple[GuestImageFact, ...] = field(default_factory=simulated_guest_images)  # the node's set
    hotplug: tuple[str, ...] = SIMULATED_HOTPLUG
    launches: dict[str, int] | None = None  # no process is made for a simulated shim: not counted
    sink: ReportSink | None = None
    _pending: dict[str, ShimSpec] = field(default_factory=dict)
    _start_ids: dict[str, str | None] = field(default_factory=dict)
    _undelivered: dict[str, list[ShimReport]] = field(default_factory=dict)

    host_devices = False

    def bind(self, sink: ReportSink) -> None:
        self.sink = sink

    def release_files(self, sandbox_id: str) -> list[str]:
        return []

    def claim(self, shim_id: str, claim: ShimClaim, timeout_s: float) -> ShimClaimAck:
        """As the real shim's control socket: a stopped shim (`SimulatedPciHost.pause`) answers once continued,
        or never within `timeout_s`; a shim that is gone (or killed while stopped) answers nothing."""
        deadline = time.monotonic() + timeout_s
        while (pid := self.host.find_process(f"shim:{shim_id}")) is not None and self.host.stopped(pid):
            if time.monotonic() >= deadline:
                return ShimClaimAck(ok=False, code="warm.claim_unanswered", message="timed out: the shim is stopped")
            time.sleep(0.05)
        if pid is None:
            return ShimClaimAck(ok=False, code="warm.claim_unanswered", message="no shim")
        self._report(shim_id, WarmClaimed(claimed_as=claim.sandbox_id))
        return ShimClaimAck(ok=True, rebind_ms=0.0)

    def workload_socket(self, sandbox_id: str) -> Path | None:
        return None  # simulated guests run no workload service

    def retire_runs(self, open_ids: Callable[[], set[str]]) -> list[str]:
        return []

    def _report(self, sid: str, details: ReportDetails, dev_ids: tuple[str, ...] = ()) -> None:
        report = ShimReport(sid, details.kind, dev_ids, details.to_json(), time.time(), self._start_id(sid))
        if sid in self.cubelet_down:
            self._undelivered.setdefault(sid, []).append(report)
        elif self.sink is not None:
            self.sink(report)

    def _start_id(self, sid: str) -> str | None:
        """The running shim's own start id (from its "command line"), surviving a Cubelet restart."""
        if sid in self._start_ids:
            return self._start_ids[sid]
        pid = self.host.find_process(f"shim:{sid}")
        cmd = self.host.command_of(pid) if pid is not None else None
        if cmd and "--start-id " in cmd:
            value = cmd.split("--start-id ", 1)[1].split()[0]
            return None if value == "None" else value
        return None

    def start(self, spec: ShimSpec) -> None:
        sid = spec.sandbox_id
        self._start_ids[sid] = spec.start_id
        self.host.spawn(f"shim:{sid}", f"cubeaccel shim run --sandbox {sid} --start-id {spec.start_id}")
        if sid in self.slow_start:
            self._pending[sid] = spec
            return
        self._boot(spec)

    def finish_start(self, sandbox_id: str) -> None:
        spec = self._pending.pop(sandbox_id)
        if self.host.find_process(f"shim:{sandbox_id}") is not None:
            self._boot(spec)

    def node_facts(self) -> NodeFacts:
        return NodeFacts(self.guest_images, self.hotplug)

    def _boot(self, spec: ShimSpec) -> None:
        sid = spec.sandbox_id
        dev_ids = tuple(d.device_id for d in spec.devices)
        refused = self._refusal(spec)
        if refused is not None:  # as the real shim: before any VMM exists
            self._report(sid, refused, dev_ids)
            return
        vmm = self.host.spawn(
            f"vmm:{sid}", f"qemu-system-x86_64 -name cubeaccel-sandbox={sid}", immortal=sid in self.immortal_vmm
        )
        self._report(sid, VmStarted(pid=vmm, vmm="simulated", image_digest=spec.image_digest))
        if spec.pin_memory:
            self._report(sid, MemoryPinned(vmlck_kib=spec.memory_mib * 1024, guest_kib=spec.memory_mib * 1024))
        self._report(sid, GuestReady())
        if sid in self.fail_attach:
            self._report(sid, AttachFailed(reason="device_add failed (injected)", layer="backend"), dev_ids)
            return
        for i, d in enumerate(spec.devices):
            assert d.address is not None  # Cubelet's lifecycle always names the host device
            self.host.add_holder(PciAddress.parse(d.address), Holder(vmm, "qemu-system-x86_64", "/dev/vfio/sim"))
            self._report(sid, DeviceAttached(guest_address=guest_address(i)), (d.device_id,))
        if sid in self.failed_guest_validation:
            self._report(
                sid,
                GuestValidationFailed(
                    failed_layers=["kernel_driver"],
                    violations=[{"layer": "kernel_driver", "code": "compat.kernel_driver_not_loaded"}],
                ),
                dev_ids,
            )
        else:
            self._report(sid, GuestValidated(report=simulated_guest_report(spec).to_json()), dev_ids)

    def _refusal(self, spec: ShimSpec) -> AttachFailed | None:
        """The real shim's refusals (shim/process.py), judged on the simulated node's facts."""
        if not spec.hotplug and spec.devices:  # a CPU-only sandbox plugs nothing
            return AttachFailed(
                reason="shim.coldplug_unsupported",
                layer="backend",
                message="the template expects cold-plug; this VMM only hot-plugs",
            )
        if not self.hotplug and spec.devices:
            return AttachFailed(reason="vmm.hotplug_unsupported", layer="backend", message="this VMM cannot hot-plug")
        if spec.image_digest is None or spec.image_digest not in {i.digest for i in self.guest_images}:
            return AttachFailed(
                reason="shim.image_not_found",
                layer="template",
                message=f"guest image {spec.image_digest} is not on this node",
            )
        return None

    def stop(self, sandbox_id: str) -> None:
        vmm = self.host.find_process(f"vmm:{sandbox_id}")
        if vmm is not None:
            if sandbox_id in self.uncooperative_guest:
                self._report(sandbox_id, DetachTimeout(timeout_s=5.0))
            else:
                for f in self.host.functions():
                    if any(h.pid == vmm for h in self.host.holders(f.address)):
                        self.host.remove_holders(f.address, vmm)
                self._report(sandbox_id, DeviceDetached())
            if self.host.kill(vmm):
                self._report(sandbox_id, VmmExited(pid=vmm, status=0))
        shim = self.host.find_process(f"shim:{sandbox_id}")
        if shim is not None and self.host.kill(shim):
            self._report(sandbox_id, ShimExiting())

    def kill(self, sandbox_id: str) -> None:
        for tag in (f"vmm:{sandbox_id}", f"shim:{sandbox_id}"):
            pid = self.host.find_process(tag)
            if pid is not None:
                self.host.kill(pid)

    def pending_reports(self, sandbox_id: str) -> list[ShimReport]:
        return self._undelivered.pop(sandbox_id, [])

    def status(self, sandbox_id: str) -> ShimStatus:
        vmm = self.host.find_process(f"vmm:{sandbox_id}")
        shim = self.host.find_process(f"shim:{sandbox_id}")
        return ShimStatus(shim_alive=shim is not None, vmm_alive=vmm is not None, vmm_pid=vmm)
