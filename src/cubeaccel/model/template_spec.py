"""The accelerator template as plain data, and its canonical JSON document.

The JSON document has the same shape as the YAML file an operator writes (`apiVersion: cubeaccel/v1`,
`kind: AcceleratorTemplate`, `metadata`, `spec`), so a frozen contract embeds exactly what was written.
Schema validation of user input (unknown fields, types) happens at the edge in `cubeaccel.wire.templates`;
this module only builds values and trusts nothing it cannot check cheaply. Semantic checks (versions,
digests, tables) are `contract.check_template`'s job, so that each failure can name its layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cubeaccel.model.device import parse_hex_id
from cubeaccel.model.sandbox_policy import SandboxPolicy
from cubeaccel.protocol.errors import CubeError

API_VERSION = "cubeaccel/v1"
KIND = "AcceleratorTemplate"
CUDA_COMPAT_MODES = ("toolkit", "minor_version")
# The class and backend of a template without `spec.accelerator`: a CPU-only sandbox, no device in its path.
NO_ACCELERATOR = "none"


@dataclass(frozen=True)
class DeviceMatch:
    """One kind of physical device the template supports. `labels` must all be equal on the device."""

    vendor_id: int
    device_id: int
    labels: dict[str, str] = field(default_factory=dict)
    min_memory_gib: int | None = None

    @property
    def vendor_device(self) -> str:
        return f"{self.vendor_id:04x}:{self.device_id:04x}"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"vendor_id": f"{self.vendor_id:04x}", "device_id": f"{self.device_id:04x}"}
        if self.labels:
            out["labels"] = dict(sorted(self.labels.items()))
        if self.min_memory_gib is not None:
            out["min_memory_gib"] = self.min_memory_gib
        return out


@dataclass(frozen=True)
class GuestKernel:
    version: str  # `uname -r` inside the guest, e.g. 6.1.0-27-cloud-amd64
    digest: str  # sha256:<64 hex> of the kernel image file


@dataclass(frozen=True)
class ModulesImg:
    kernel_version: str  # the kernel release the modules were built for (must equal GuestKernel.version)
    digest: str


@dataclass(frozen=True)
class KernelDriver:
    module: str  # the module that drives the device, as /proc/modules names it (nvidia)
    version: str  # /sys/module/<module>/version, e.g. 550.54.15


@dataclass(frozen=True)
class UserspaceDriver:
    version: str  # must equal the kernel driver version for NVIDIA (else "API mismatch" at cuInit)
    libraries: tuple[str, ...] = ()  # sonames whose version must be `version` (libcuda.so.1, ...)


@dataclass(frozen=True)
class CudaSpec:
    version: str  # toolkit the workload was built with: 12.4 (GA) or 12.4.1 (Update 1)
    compatibility: str = "toolkit"  # toolkit: driver >= the toolkit's own; minor_version: >= the major's floor


@dataclass(frozen=True)
class ProbeSpec:
    """What cube-agent checks inside the guest beyond kernel, driver and CUDA."""

    modules: tuple[str, ...] = ()  # must be loaded (listed in /proc/modules)
    device_files: tuple[str, ...] = ()  # must exist (/dev/nvidia0, ...)
    libraries: tuple[str, ...] = ()  # runtime libraries that must load (libcudart.so.12, ...)


@dataclass(frozen=True)
class GuestInit:
    """Guest-init steps cube-agent performs before it probes, and only because the contract asks.

    `load_modules`: modprobe the probe modules (from modules.img) first; false: they must already be loaded.
    `persistence_mode`: turn NVML persistence mode on for every device, and require it on (layer
    userspace_driver); it keeps the driver initialised between CUDA clients, avoiding a cold init each time.
    """

    load_modules: bool = True
    persistence_mode: bool = False

    def to_json(self) -> dict[str, bool]:
        return {"load_modules": self.load_modules, "persistence_mode": self.persistence_mode}


@dataclass(frozen=True)
class Template:
    name: str
    version: str
    accel_class: str
    backend: str
    devices: tuple[DeviceMatch, ...]
    guest_image_digest: str
    guest_kernel: GuestKernel
    modules_img: ModulesImg
    memory_mib: int
    pin_memory: bool
    hotplug: bool
    kernel_driver: KernelDriver | None = None
    userspace_driver: UserspaceDriver | None = None
    cuda: CudaSpec | None = None
    probes: ProbeSpec = field(default_factory=ProbeSpec)
    description: str = ""
    init: GuestInit = field(default_factory=GuestInit)
    sandbox: SandboxPolicy = field(default_factory=SandboxPolicy)  # network, files, refused cases (sandbox_policy)

    @property
    def cpu_only(self) -> bool:
        """No accelerator: scheduled on memory alone, started without hot-plug, released with nothing to scrub."""
        return self.accel_class == NO_ACCELERATOR

    def to_json(self) -> dict[str, Any]:
        """The canonical document (same shape as the file). Freezing hashes exactly this."""
        driver: dict[str, Any] = {}
        if self.kernel_driver is not None:
            driver["kernel"] = {"module": self.kernel_driver.module, "version": self.kernel_driver.version}
        if self.userspace_driver is not None:
            driver["userspace"] = {
                "version": self.userspace_driver.version,
                "libraries": list(self.userspace_driver.libraries),
            }
        spec: dict[str, Any] = {
            "guest": {
                "image": {"digest": self.guest_image_digest},
                "kernel": {"version": self.guest_kernel.version, "digest": self.guest_kernel.digest},
                "modules_img": {"kernel_version": self.modules_img.kernel_version, "digest": self.modules_img.digest},
            },
            "driver": driver or None,
            "cuda": ({"version": self.cuda.version, "compatibility": self.cuda.compatibility} if self.cuda else None),
            "memory": {"size_mib": self.memory_mib, "pinned": self.pin_memory},
            "hotplug": self.hotplug,
            "probes": {
                "modules": list(self.probes.modules),
                "device_files": list(self.probes.device_files),
                "libraries": list(self.probes.libraries),
            },
        }
        if not self.cpu_only:  # a CPU-only template's document has no accelerator section, as written
            devices = [d.to_json() for d in self.devices]
            spec = {"accelerator": {"class": self.accel_class, "backend": self.backend, "devices": devices}, **spec}
        if self.init != GuestInit():  # defaults are left out: contracts frozen before `init` keep their digest
            spec["guest"]["init"] = self.init.to_json()
        if sandbox := self.sandbox.to_json():  # likewise: no section, the closed defaults, the old digest
            spec["sandbox"] = sandbox
        meta: dict[str, Any] = {"name": self.name, "version": self.version}
        if self.description:
            meta["description"] = self.description
        return {"apiVersion": API_VERSION, "kind": KIND, "metadata": meta, "spec": spec}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Template:
        """Build from a document already validated by `cubeaccel.wire.templates` or written by `to_json`.

        Shape errors become `template.invalid_document` rather than KeyError/TypeError, because stored
        contracts are read back from disk and a corrupt one must fail with a code, not a traceback.
        """
        try:
            return _from_doc(doc)
        except CubeError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CubeError(
                "template.invalid_document",
                f"not a template document: {type(e).__name__}: {e}",
                "template",
            ) from e


def _from_doc(doc: dict[str, Any]) -> Template:
    if doc.get("apiVersion") != API_VERSION or doc.get("kind") != KIND:
        raise CubeError(
            "template.unsupported_api_version",
            f"expected apiVersion {API_VERSION!r} and kind {KIND!r}, got {doc.get('apiVersion')!r}/{doc.get('kind')!r}",
            "template",
        )
    meta, spec = doc["metadata"], doc["spec"]
    acc, guest = spec.get("accelerator"), spec["guest"]
    if acc is None:
        acc = {"class": NO_ACCELERATOR, "backend": NO_ACCELERATOR, "devices": []}
    driver = spec.get("driver") or {}
    kd, ud, cuda = driver.get("kernel"), driver.get("userspace"), spec.get("cuda")
    probes = spec.get("probes") or {}
    init = guest.get("init") or {}
    return Template(
        name=str(meta["name"]),
        version=str(meta["version"]),
        description=str(meta.get("description", "")),
        accel_class=str(acc["class"]),
        backend=str(acc["backend"]),
        devices=tuple(
            DeviceMatch(
                vendor_id=parse_hex_id(str(d["vendor_id"])),
                device_id=parse_hex_id(str(d["device_id"])),
                labels={str(k): str(v) for k, v in (d.get("labels") or {}).items()},
                min_memory_gib=None if d.get("min_memory_gib") is None else int(d["min_memory_gib"]),
            )
            for d in acc["devices"]
        ),
        guest_image_digest=str(guest["image"]["digest"]),
        guest_kernel=GuestKernel(str(guest["kernel"]["version"]), str(guest["kernel"]["digest"])),
        modules_img=ModulesImg(str(guest["modules_img"]["kernel_version"]), str(guest["modules_img"]["digest"])),
        kernel_driver=KernelDriver(str(kd["module"]), str(kd["version"])) if kd else None,
        userspace_driver=(
            UserspaceDriver(str(ud["version"]), tuple(str(x) for x in ud.get("libraries", ()))) if ud else None
        ),
        cuda=CudaSpec(str(cuda["version"]), str(cuda.get("compatibility", "toolkit"))) if cuda else None,
        memory_mib=int(spec["memory"]["size_mib"]),
        pin_memory=bool(spec["memory"]["pinned"]),
        hotplug=bool(spec["hotplug"]),
        probes=ProbeSpec(
            modules=tuple(str(x) for x in probes.get("modules", ())),
            device_files=tuple(str(x) for x in probes.get("device_files", ())),
            libraries=tuple(str(x) for x in probes.get("libraries", ())),
        ),
        init=GuestInit(
            load_modules=bool(init.get("load_modules", True)),
            persistence_mode=bool(init.get("persistence_mode", False)),
        ),
        sandbox=SandboxPolicy.from_json(spec.get("sandbox")),
    )
