"""The compatibility contract: a template frozen for one sandbox, and the stages that check it.

Five stages (ARCHITECTURE §4), each returning `ContractViolation`s rather than raising, because an
expected mismatch is an answer, not a crash:

1. registration — `check_template(t)` (CubeMaster, `cubeaccel template validate`)
2. scheduling   — `check_node(t, node)` (CubeMaster's filter, one call per node)
3. reservation  — `check_device(contract, device)` (Cubelet, inside the reservation transaction)
4. hot-plug     — memory allocated and locked before attach (CubeShim; `contract.pin_memory` tells it)
5. guest        — `check_guest(contract, report)` (Cubelet, on cube-agent's report)

A sandbox keeps a `CompatibilityContract` (= `FrozenContract`): the template document as it was at
creation, with its name, version and the sha256 of its canonical JSON. Editing the template later
changes neither the copy nor its digest.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from cubeaccel.model.device import DeviceRecord
from cubeaccel.model.guest_checks import check_guest_template, min_driver_api, module_key
from cubeaccel.model.node_facts import GuestImageFact
from cubeaccel.model.registration_checks import check_template
from cubeaccel.model.template_spec import DeviceMatch, ProbeSpec, Template
from cubeaccel.model.violations import ContractViolation, Layer
from cubeaccel.protocol.errors import CubeError
from cubeaccel.protocol.reports import GuestReport

__all__ = [
    "CompatibilityContract",
    "ContractViolation",
    "FrozenContract",
    "GuestProbeSpec",
    "Layer",
    "NodeSummary",
    "ProbeSpec",
    "Template",
    "check_device",
    "check_guest",
    "check_node",
    "check_template",
    "freeze",
]

CONTRACT_VERSION = 1
L = Layer
V = ContractViolation


def canonical_json(doc: Mapping[str, Any]) -> bytes:
    """Sorted keys, no whitespace, UTF-8: the bytes the digest is taken over."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def template_digest(t: Template) -> str:
    return "sha256:" + hashlib.sha256(canonical_json(t.to_json())).hexdigest()


@dataclass(frozen=True)
class GuestProbeSpec:
    """What cube-agent must check, flattened to plain JSON so the stdlib-only agent never parses templates.

    `modules` starts with the kernel driver's module. `libraries` holds the user-space driver libraries
    (their file version must equal the driver version; layer userspace_driver) and then the runtime
    libraries (only loaded; layer cuda_runtime). `pci`: any one of these must be visible in the guest —
    the reserved devices when known, else every device kind the template supports. `load_modules` and
    `persistence_mode` are the template's guest-init steps (`spec.guest.init`): the agent performs them
    only because the contract asks.
    """

    kernel_release: str
    modules: tuple[str, ...]
    kernel_driver: dict[str, str] | None  # {"module", "version"}
    device_files: tuple[str, ...]
    libraries: tuple[dict[str, str | None], ...]  # {"name", "version" (or None), "layer"}
    pci: tuple[dict[str, str], ...]  # {"vendor_id", "device_id"}
    cuda: dict[str, Any] | None  # {"version", "min_driver_api"}
    load_modules: bool = True
    persistence_mode: bool = False

    @classmethod
    def of(cls, t: Template, devices: Sequence[DeviceRecord] | None = None) -> GuestProbeSpec:
        mods = [t.kernel_driver.module] if t.kernel_driver else []
        mods += [m for m in t.probes.modules if module_key(m) not in {module_key(x) for x in mods}]
        libs: list[dict[str, str | None]] = []
        if t.userspace_driver:
            libs += [
                {"name": n, "version": t.userspace_driver.version, "layer": L.USERSPACE_DRIVER.value}
                for n in t.userspace_driver.libraries
            ]
        libs += [{"name": n, "version": None, "layer": L.CUDA_RUNTIME.value} for n in t.probes.libraries]
        if devices:
            ids = sorted({(d.identity.vendor_id, d.identity.device_id) for d in devices})
        else:
            ids = sorted({(m.vendor_id, m.device_id) for m in t.devices})
        need = min_driver_api(t)
        return cls(
            kernel_release=t.guest_kernel.version,
            modules=tuple(mods),
            kernel_driver=(
                {"module": t.kernel_driver.module, "version": t.kernel_driver.version} if t.kernel_driver else None
            ),
            device_files=t.probes.device_files,
            libraries=tuple(libs),
            pci=tuple({"vendor_id": f"{v:04x}", "device_id": f"{d:04x}"} for v, d in ids),
            cuda={"version": t.cuda.version, "min_driver_api": need} if t.cuda and need is not None else None,
            load_modules=t.init.load_modules,
            persistence_mode=t.init.persistence_mode,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "kernel_release": self.kernel_release,
            "modules": list(self.modules),
            "kernel_driver": self.kernel_driver,
            "device_files": list(self.device_files),
            "libraries": [dict(x) for x in self.libraries],
            "pci": [dict(x) for x in self.pci],
            "cuda": self.cuda,
            "load_modules": self.load_modules,
            "persistence_mode": self.persistence_mode,
        }


@dataclass(frozen=True)
class CompatibilityContract:
    """A sandbox's own copy of its template. Build it with `freeze`; store it with `to_json`."""

    template: Template
    digest: str

    @property
    def template_name(self) -> str:
        return self.template.name

    @property
    def template_version(self) -> str:
        return self.template.version

    @property
    def memory_mib(self) -> int:
        return self.template.memory_mib

    @property
    def pin_memory(self) -> bool:
        return self.template.pin_memory

    @property
    def hotplug(self) -> bool:
        return self.template.hotplug

    @property
    def backend(self) -> str:
        return self.template.backend

    @property
    def accel_class(self) -> str:
        return self.template.accel_class

    def guest_probes(self, devices: Sequence[DeviceRecord] | None = None) -> GuestProbeSpec:
        """The agent's part; pass the reserved devices so the agent looks for exactly those."""
        return GuestProbeSpec.of(self.template, devices)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON. `guest_probes` is derived from `document` (cube-agent reads it; reading back ignores it)."""
        return {
            "contract_version": CONTRACT_VERSION,
            "template": {"name": self.template.name, "version": self.template.version, "digest": self.digest},
            "document": self.template.to_json(),
            "guest_probes": self.guest_probes().to_json(),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CompatibilityContract:
        """Read a stored contract back; a document that no longer hashes to its digest is refused."""
        try:
            version = data["contract_version"]
            doc, digest = data["document"], data["template"]["digest"]
        except (KeyError, TypeError) as e:
            raise CubeError("contract.invalid_json", f"not a frozen contract: missing {e}", "template") from e
        if version != CONTRACT_VERSION:
            raise CubeError(
                "contract.unsupported_version",
                f"contract_version {version!r} is not {CONTRACT_VERSION}",
                "template",
            )
        if not isinstance(doc, dict):
            raise CubeError("contract.invalid_json", "contract document is not an object", "template")
        t = Template.from_json(doc)
        actual = template_digest(t)
        if actual != digest:
            raise CubeError(
                "contract.digest_mismatch",
                f"stored contract digest {digest} does not match its document ({actual})",
                "template",
                details={"expected": digest, "found": actual},
            )
        return cls(template=t, digest=digest)


FrozenContract = CompatibilityContract


def freeze(t: Template) -> CompatibilityContract:
    """Copy `t` into a contract. Template values are immutable, so later edits make new templates."""
    return CompatibilityContract(template=t, digest=template_digest(t))


def _tpl(x: Template | CompatibilityContract) -> Template:
    return x.template if isinstance(x, CompatibilityContract) else x


# --- stage 2: scheduling ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeSummary:
    """What CubeMaster knows about a node: summaries only, never node-local device state.

    `devices` holds the label sets of the node's *allocatable* devices (as `profiles.labels_for` writes
    them). `guest_images` are the guests the node can boot and `hotplug` the hot-plug paths its VMM
    supports (model/node_facts.py); empty means none, and a template needing one is refused there.
    """

    backends: AbstractSet[str]
    devices: Sequence[Mapping[str, str]]
    pinnable_memory_mib: int
    guest_images: Sequence[GuestImageFact] = ()
    hotplug: AbstractSet[str] = frozenset()
    name: str = ""


def label_mismatch(m: DeviceMatch, labels: Mapping[str, str]) -> str | None:
    """Why a device with `labels` does not satisfy `m`, or None when it does."""
    vid, did = labels.get("vendor_id", ""), labels.get("device_id", "")
    if (vid.lower().removeprefix("0x"), did.lower().removeprefix("0x")) != (f"{m.vendor_id:04x}", f"{m.device_id:04x}"):
        return f"{vid}:{did}"
    for k, want in sorted(m.labels.items()):
        if labels.get(k) != want:
            return f"{k}={labels.get(k, '<unset>')}"
    if m.min_memory_gib is not None:
        try:
            gib = int(labels.get("memory_gib", ""))
        except ValueError:
            return "memory_gib=<unset>"
        if gib < m.min_memory_gib:
            return f"memory_gib={gib}"
    return None


def _describe(m: DeviceMatch) -> str:
    extra = [f"{k}={v}" for k, v in sorted(m.labels.items())]
    if m.min_memory_gib is not None:
        extra.append(f"memory_gib>={m.min_memory_gib}")
    return m.vendor_device + (f" ({', '.join(extra)})" if extra else "")


def check_node(t: Template | CompatibilityContract, node: NodeSummary) -> list[ContractViolation]:
    """Per-node rejection reasons for the scheduler; empty when the node can host the template."""
    tp, out = _tpl(t), []
    if tp.cpu_only:  # no device, backend or hot-plug: lockable memory and the guest it boots decide
        return _memory(tp, node) + _guest_facts(tp, node)
    if tp.backend not in node.backends:
        out.append(
            V(L.BACKEND, "compat.node_backend_unavailable", tp.backend, ", ".join(sorted(node.backends)) or "none")
        )
    if tp.hotplug and not node.hotplug:
        out.append(
            V(
                L.BACKEND,
                "compat.node_hotplug_unsupported",
                "a VMM that can hot-plug PCI devices",
                "no hot-plug path reported",
            )
        )
    usable = [
        lbl
        for lbl in node.devices
        if lbl.get("backend", tp.backend) == tp.backend and any(label_mismatch(m, lbl) is None for m in tp.devices)
    ]
    if not usable:
        models = sorted({lbl.get("model", "?") for lbl in node.devices})
        out.append(
            V(
                L.HOST_HARDWARE,
                "compat.node_no_matching_device",
                "a free " + " or ".join(_describe(m) for m in tp.devices),
                ", ".join(models) if models else "no free devices",
            )
        )
    out.extend(_memory(tp, node))
    out.extend(_guest_facts(tp, node))
    return out


def _memory(tp: Template, node: NodeSummary) -> list[ContractViolation]:
    if tp.pin_memory and tp.memory_mib > node.pinnable_memory_mib:
        return [
            V(
                L.PINNED_MEMORY,
                "compat.node_pinned_memory_insufficient",
                f"{tp.memory_mib} MiB lockable",
                f"{node.pinnable_memory_mib} MiB",
            )
        ]
    return []


def _guest_facts(tp: Template, node: NodeSummary) -> list[ContractViolation]:
    """The pinned kernel (release + digest), image and modules.img against the guests the node holds.

    The shim boots the image by its digest, so that one image must carry the pinned kernel and modules.img;
    a node holding the kernel only in another image would fail at the shim, so it is refused here.
    """
    out, k, images = [], tp.guest_kernel, node.guest_images
    releases = ", ".join(sorted({i.kernel_release for i in images})) or "no guest images"
    kernel_ok = [i for i in images if i.kernel_release == k.version and k.digest in i.kernel_digests]
    if not kernel_ok:
        out.append(V(L.GUEST_KERNEL, "compat.node_guest_kernel_unavailable", f"{k.version} ({k.digest})", releases))
    pinned = next((i for i in images if i.digest == tp.guest_image_digest), None)
    if pinned is None:
        out.append(
            V(
                L.TEMPLATE,
                "compat.node_guest_image_unavailable",
                tp.guest_image_digest,
                f"{len(images)} images" if images else "no guest images",
            )
        )
        return out
    if kernel_ok and pinned not in kernel_ok:
        out.append(
            V(
                L.GUEST_KERNEL,
                "compat.node_guest_kernel_unavailable",
                f"{k.version} ({k.digest})",
                f"image {pinned.digest} boots {pinned.kernel_release}",
            )
        )
    if pinned.modules_img_digest != tp.modules_img.digest:
        out.append(
            V(
                L.MODULES_IMG,
                "compat.node_modules_img_unavailable",
                tp.modules_img.digest,
                f"image {pinned.digest} carries {pinned.modules_img_digest}",
            )
        )
    return out


# --- stage 3: reservation ---------------------------------------------------------------------------------


def check_device(
    contract: Template | CompatibilityContract,
    device: DeviceRecord,
    *,
    pinnable_memory_mib: int | None = None,
) -> list[ContractViolation]:
    """Does this physical device (and, if given, the node's lockable memory) still satisfy the contract?"""
    t, out = _tpl(contract), []
    if device.backend != t.backend:
        out.append(V(L.BACKEND, "compat.device_backend_mismatch", t.backend, device.backend))
    if device.accel_class.value != t.accel_class:
        out.append(V(L.HOST_HARDWARE, "compat.device_class_mismatch", t.accel_class, device.accel_class.value))
    ident = device.identity
    same_ids = [m for m in t.devices if (m.vendor_id, m.device_id) == (ident.vendor_id, ident.device_id)]
    if not same_ids:
        out.append(
            V(
                L.HOST_HARDWARE,
                "compat.device_not_supported",
                " or ".join(m.vendor_device for m in t.devices) or "a listed device",
                f"{ident.vendor_device} ({device.labels.get('model', 'unknown model')})",
                "the template lists the devices its driver stack was validated on",
            )
        )
    else:
        labels = {**device.labels, "vendor_id": f"{ident.vendor_id:04x}", "device_id": f"{ident.device_id:04x}"}
        reasons = [r for m in same_ids if (r := label_mismatch(m, labels)) is not None]
        if len(reasons) == len(same_ids):
            memory = all(r.startswith("memory_gib=") for r in reasons)
            out.append(
                V(
                    L.HOST_HARDWARE,
                    "compat.device_memory_too_small" if memory else "compat.device_label_mismatch",
                    " or ".join(_describe(m) for m in same_ids),
                    reasons[0],
                )
            )
    if t.pin_memory and pinnable_memory_mib is not None and t.memory_mib > pinnable_memory_mib:
        out.append(
            V(
                L.PINNED_MEMORY,
                "compat.pinned_memory_insufficient",
                f"{t.memory_mib} MiB lockable",
                f"{pinnable_memory_mib} MiB",
                "guest memory is allocated and locked before hot-plug; the node cannot lock this much now",
            )
        )
    return out


# --- stage 5: guest ---------------------------------------------------------------------------------------


def check_guest(
    contract: Template | CompatibilityContract,
    report: GuestReport,
    *,
    device: DeviceRecord | None = None,
) -> list[ContractViolation]:
    """Judge cube-agent's raw facts against the contract. With `device`, that exact vendor:device must be
    visible in the guest; without, any device the template supports."""
    return check_guest_template(_tpl(contract), report, device)
