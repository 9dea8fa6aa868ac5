"""Messages that cross process boundaries: shim → Cubelet reports and cube-agent's guest report.

Pure data with JSON round-trips, so the shim (a separate process) and the in-process test driver
speak exactly the same shapes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any


class ShimReportKind(StrEnum):
    """What a shim tells Cubelet. Only Cubelet turns these into device transitions. Each kind's details are its
    model in `wire.reports` (`VmStarted`, ...), which both the shim and the Cubelet use."""

    VM_STARTED = "vm_started"
    VMM_CONFINED = "vmm_confined"  # /proc: uid, caps, seccomp, mount ns as launched
    MEMORY_PINNED = "memory_pinned"
    GUEST_READY = "guest_ready"  # cube-agent said hello
    WORKLOAD_READY = "workload_ready"  # the workload service answered over its channel
    DEVICE_ATTACHED = "device_attached"  # VMM confirmed and the guest saw vendor:device
    ATTACH_FAILED = "attach_failed"
    GUEST_VALIDATED = "guest_validated"
    GUEST_VALIDATION_FAILED = "guest_validation_failed"
    DEVICE_DETACHED = "device_detached"  # DEVICE_DELETED seen
    DETACH_TIMEOUT = "detach_timeout"  # no DEVICE_DELETED within the bound
    VMM_EXITED = "vmm_exited"  # the VMM process was waited for
    SHIM_EXITING = "shim_exiting"
    WARM_CLAIMED = "warm_claimed"  # a warm shim's bridge serves the claimant's token
    SCRUB_FINISHED = "scrub_finished"  # scrub VMs only (docs/scrub.md)


@dataclass(frozen=True)
class ShimReport:
    """Its JSON form (the shim's POST body, an `undelivered.jsonl` line) is `wire.reports.ShimReportBody`.

    `details` stays the JSON as sent (docs/decisions.md): the event trail keeps it so, and each reader parses it
    with its kind's model."""

    sandbox_id: str
    kind: ShimReportKind
    device_ids: tuple[str, ...] = ()
    details: dict[str, Any] = field(default_factory=dict)
    at: float = 0.0
    start_id: str | None = None  # which start of the sandbox this shim serves: stale reports are refused


@dataclass(frozen=True)
class ProbeResult:
    """One timed in-guest probe: what the contract expected, what the guest showed."""

    name: str
    ok: bool
    layer: str  # one of the contract layers (guest_kernel, modules_img, kernel_driver, ...)
    code: str  # stable code when not ok, e.g. compat.kernel_driver_missing; "" when ok
    expected: str | None = None
    found: str | None = None
    duration_ms: float = 0.0
    detail: str = ""


@dataclass(frozen=True)
class GuestReport:
    """cube-agent's answer to `probe`. Raw facts plus per-probe verdicts.

    Facts are kept raw (kernel release, module lists, PCI devices, versions) so the contract's
    `check_guest` can judge them again on the host side, independently of the agent's own verdicts.
    """

    agent_version: int
    kernel_release: str
    modules_loaded: tuple[str, ...] = ()
    module_failures: dict[str, str] = field(default_factory=dict)  # module → error text
    # The driver module was in modules.img, built for this kernel, and its own init refused: the kernel's words.
    driver_refusal: str | None = None
    pci_devices: tuple[dict[str, str], ...] = ()  # {"address", "vendor_id", "device_id", "class"}
    device_files: dict[str, bool] = field(default_factory=dict)
    kernel_driver_version: str | None = None
    libraries: dict[str, dict[str, Any]] = field(default_factory=dict)  # name → {loaded, version, error}
    cuda: dict[str, Any] | None = None  # {driver_version, init_ok, device_count, error}
    nvml: dict[str, Any] | None = None
    probes: tuple[ProbeResult, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GuestReport:
        return cls(
            agent_version=int(data["agent_version"]),
            kernel_release=str(data["kernel_release"]),
            modules_loaded=tuple(data.get("modules_loaded", ())),
            module_failures=dict(data.get("module_failures", {})),
            driver_refusal=data.get("driver_refusal"),
            pci_devices=tuple(dict(d) for d in data.get("pci_devices", ())),
            device_files=dict(data.get("device_files", {})),
            kernel_driver_version=data.get("kernel_driver_version"),
            libraries=dict(data.get("libraries", {})),
            cuda=data.get("cuda"),
            nvml=data.get("nvml"),
            probes=tuple(ProbeResult(**p) for p in data.get("probes", ())),
        )
