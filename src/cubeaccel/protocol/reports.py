"""Messages that cross process boundaries: shim → Cubelet reports and cube-agent's guest report.

Pure data with JSON round-trips, so the shim (a separate process) and the in-process test driver
speak exactly the same shapes.
"""

from __future__ import annotations

from collections.abc import Mapping
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
    WORKLOAD_UNRESPONSIVE = "workload_unresponsive"  # it stopped answering: calls fail with workload.unresponsive
    WORKLOAD_RECOVERED = "workload_recovered"  # it answers /health again after being unresponsive
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

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ProbeResult:
        """Strict: an unknown or missing field is a TypeError (the Cubelet calls the report malformed)."""
        return cls(**data)


def _opt_str(value: object) -> str | None:
    return None if value is None else str(value)


def _opt_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class LibraryInfo:
    """One driver library as the guest's dynamic linker found it."""

    loaded: bool
    path: str | None = None
    version: str | None = None  # from the file name (libcuda.so.550.54.15 → 550.54.15)
    error: str | None = None

    def to_json(self) -> dict[str, object]:
        return {"loaded": self.loaded, "path": self.path, "version": self.version, "error": self.error}

    @classmethod
    def from_json(cls, data: object) -> LibraryInfo | None:
        """Lenient (the guest wrote it): not an object reads as not reported, a field as its text."""
        if not isinstance(data, dict):
            return None
        return cls(
            bool(data.get("loaded")),
            _opt_str(data.get("path")),
            _opt_str(data.get("version")),
            str(data["error"]) if data.get("error") else None,
        )


@dataclass(frozen=True)
class CudaInfo:
    """cuDriverGetVersion / cuInit / cuDeviceGetCount as the guest's libcuda answered. The last three fields
    are there only once that step ran (None: absent from the JSON)."""

    driver_version: int | str | None = None  # 12040 = CUDA 12.4 (the host also reads "12.4")
    init_ok: bool = False
    device_count: int | None = None
    error: str | None = None
    driver_version_text: str | None = None
    init_ms: float | None = None
    init_result: int | None = None  # cuInit's CUresult

    def to_json(self) -> dict[str, object]:
        out: dict[str, Any] = {
            "driver_version": self.driver_version,
            "init_ok": self.init_ok,
            "device_count": self.device_count,
            "error": self.error,
        }
        for key in ("driver_version_text", "init_ms", "init_result"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    @classmethod
    def from_json(cls, data: object) -> CudaInfo | None:
        """Lenient: a mistyped field reads as not reported, and its check fails on the host."""
        if not isinstance(data, dict):
            return None
        ms = data.get("init_ms")
        return cls(
            driver_version=version if isinstance(version := data.get("driver_version"), int | str) else None,
            init_ok=data.get("init_ok") is True,
            device_count=_opt_int(data.get("device_count")),
            error=str(data["error"]) if data.get("error") else None,
            driver_version_text=data.get("driver_version_text")
            if isinstance(data.get("driver_version_text"), str)
            else None,
            init_ms=float(ms) if isinstance(ms, int | float) and not isinstance(ms, bool) else None,
            init_result=_opt_int(data.get("init_result")),
        )


@dataclass(frozen=True)
class NvmlDevice:
    """One device as NVML saw it; a field NVML did not answer is None and absent from the JSON."""

    index: int
    error: str | None = None
    name: str | None = None
    memory_total_bytes: int | None = None
    persistence_mode: bool | None = None
    persistence_set_result: int | None = None  # nvmlDeviceSetPersistenceMode's return, when it was called

    def to_json(self) -> dict[str, object]:
        out: dict[str, Any] = {"index": self.index}
        for key in ("error", "name", "memory_total_bytes", "persistence_mode", "persistence_set_result"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    @classmethod
    def from_json(cls, data: object) -> NvmlDevice | None:
        if not isinstance(data, dict) or _opt_int(data.get("index")) is None:
            return None
        mode = data.get("persistence_mode")
        return cls(
            index=data["index"],
            error=_opt_str(data.get("error")),
            name=_opt_str(data.get("name")),
            memory_total_bytes=_opt_int(data.get("memory_total_bytes")),
            persistence_mode=mode if isinstance(mode, bool) else None,
            persistence_set_result=_opt_int(data.get("persistence_set_result")),
        )


@dataclass(frozen=True)
class NvmlInfo:
    driver_version: str | None = None
    device_count: int | None = None  # None: NVML did not answer
    devices: tuple[NvmlDevice, ...] = ()
    error: str | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "driver_version": self.driver_version,
            "device_count": self.device_count,
            "devices": [d.to_json() for d in self.devices],
            "error": self.error,
        }

    @classmethod
    def from_json(cls, data: object) -> NvmlInfo | None:
        if not isinstance(data, dict):
            return None
        devices = data.get("devices")
        found = (NvmlDevice.from_json(d) for d in devices) if isinstance(devices, list) else ()
        return cls(
            driver_version=_opt_str(data.get("driver_version")),
            device_count=_opt_int(data.get("device_count")),
            devices=tuple(d for d in found if d is not None),
            error=_opt_str(data.get("error")),
        )


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


@dataclass(frozen=True)
class GuestPciDevice:
    """One PCI function in the guest's report: sysfs's words, hex without 0x. Lenient (the guest wrote it): a
    field missing or not text is None, left out of the JSON, and each host check skips an entry that lacks what it
    needs (the contract's check only vendor:device, the check without a contract the address too)."""

    address: str | None = None
    vendor_id: str | None = None
    device_id: str | None = None
    class_: str | None = None

    def to_json(self) -> dict[str, str]:
        out = {"address": self.address, "vendor_id": self.vendor_id, "device_id": self.device_id, "class": self.class_}
        return {k: v for k, v in out.items() if v is not None}

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> GuestPciDevice:
        return cls(
            _text(data.get("address")),
            _text(data.get("vendor_id")),
            _text(data.get("device_id")),
            _text(data.get("class")),
        )


def _items(value: object) -> list[tuple[object, object]]:
    """A JSON object's entries; `dict(x)` of anything else used to be a TypeError (report malformed)."""
    return list(dict(value).items())  # type: ignore[call-overload]


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
    pci_devices: tuple[GuestPciDevice, ...] = ()
    device_files: dict[str, bool] = field(default_factory=dict)
    kernel_driver_version: str | None = None
    libraries: dict[str, LibraryInfo] = field(default_factory=dict)
    cuda: CudaInfo | None = None
    nvml: NvmlInfo | None = None
    probes: tuple[ProbeResult, ...] = ()

    def to_json(self) -> dict[str, object]:
        return {
            "agent_version": self.agent_version,
            "kernel_release": self.kernel_release,
            "modules_loaded": list(self.modules_loaded),
            "module_failures": dict(self.module_failures),
            "driver_refusal": self.driver_refusal,
            "pci_devices": [d.to_json() for d in self.pci_devices],
            "device_files": dict(self.device_files),
            "kernel_driver_version": self.kernel_driver_version,
            "libraries": {name: lib.to_json() for name, lib in self.libraries.items()},
            "cuda": None if self.cuda is None else self.cuda.to_json(),
            "nvml": None if self.nvml is None else self.nvml.to_json(),
            "probes": [p.to_json() for p in self.probes],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GuestReport:
        return cls(
            agent_version=int(data["agent_version"]),
            kernel_release=str(data["kernel_release"]),
            modules_loaded=tuple(data.get("modules_loaded", ())),
            module_failures=dict(data.get("module_failures", {})),
            driver_refusal=data.get("driver_refusal"),
            # dict(): an entry that is not an object is a TypeError or ValueError (the report is malformed)
            pci_devices=tuple(GuestPciDevice.from_json(dict(d)) for d in data.get("pci_devices", ())),
            device_files=dict(data.get("device_files", {})),
            kernel_driver_version=data.get("kernel_driver_version"),
            libraries={
                name: lib
                for name, raw in _items(data.get("libraries", {}))
                if isinstance(name, str) and (lib := LibraryInfo.from_json(raw)) is not None
            },
            cuda=CudaInfo.from_json(data.get("cuda")),
            nvml=NvmlInfo.from_json(data.get("nvml")),
            probes=tuple(ProbeResult.from_json(p) for p in data.get("probes", ())),
        )
