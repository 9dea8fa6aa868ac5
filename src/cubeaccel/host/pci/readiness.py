"""Host readiness for VFIO passthrough (`cubeaccel host check`): each prerequisite as pass/fail + reason.

Read-only: it looks at sysfs, /dev and /proc and never loads a module or writes anything. Roots are
parameters so the same code runs against fake trees in tests.

What is checked, and why each is required:
- IOMMU groups exist: without an IOMMU a device's DMA cannot be confined to one guest.
- vfio-pci is registered: the driver that hands a function to userspace (QEMU).
- /dev/vfio/vfio: the VFIO container QEMU opens (legacy interface, still the default).
- interrupt remapping: without it a guest can forge MSIs; vfio refuses unless unsafe interrupts are allowed.
- virtualization: hardware KVM. A PVM host (`kvm_pvm`, itself a nested VM, like these dev machines)
  cannot pass PCI devices through; the design puts that out of scope.
- iommufd (/dev/iommu) is reported but not required.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any


class Status(StrEnum):
    PASS = "pass"
    FAIL = "fail"
    WARN = "warn"  # not visible or not required; does not fail the check


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    reason: str
    code: str = ""  # stable code when it fails, e.g. host.no_iommu

    def to_json(self) -> dict[str, str]:
        return {"name": self.name, "status": self.status.value, "code": self.code, "reason": self.reason}


@dataclass(frozen=True)
class HostReadiness:
    checks: tuple[Check, ...]
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def ready(self) -> bool:
        return all(c.status != Status.FAIL for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.status == Status.FAIL]

    def to_json(self) -> dict[str, object]:
        return {"ready": self.ready, "checks": [c.to_json() for c in self.checks], "facts": self.facts}


@dataclass(frozen=True)
class HostRoots:
    """Where the checks look: the real host's, or a fake tree's `sys`, `dev` and `proc`."""

    sys: Path = Path("/sys")
    dev: Path = Path("/dev")
    proc: Path = Path("/proc")


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def _listdir(path: Path) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _modules(sys_root: Path, proc_root: Path) -> set[str]:
    """Loaded modules: /proc/modules (absent without module support) plus /sys/module (incl. built-ins)."""
    names = set(_listdir(sys_root / "module"))
    for line in (_read(proc_root / "modules") or "").splitlines():
        if line.split():
            names.add(line.split()[0])
    return names


def check_iommu(sys_root: Path) -> Check:
    groups = [g for g in _listdir(sys_root / "kernel" / "iommu_groups") if g.isdigit()]
    units = _listdir(sys_root / "class" / "iommu")
    if groups:
        return Check("iommu", Status.PASS, f"{len(groups)} IOMMU groups; units: {', '.join(units) or 'none listed'}")
    if units:
        reason = f"IOMMU units present ({', '.join(units)}) but no groups: boot with intel_iommu=on / amd_iommu=on"
    else:
        reason = (
            "no IOMMU: /sys/kernel/iommu_groups is empty and no IOMMU unit is listed; enable VT-d / AMD-Vi in "
            "firmware and boot with intel_iommu=on (AMD: on by default). PCI passthrough is impossible here"
        )
    return Check("iommu", Status.FAIL, reason, "host.no_iommu")


def check_vfio_pci(sys_root: Path, modules: set[str]) -> Check:
    if (sys_root / "bus" / "pci" / "drivers" / "vfio-pci").is_dir():
        return Check("vfio_pci", Status.PASS, "vfio-pci driver is registered")
    hint = "module loaded but driver not registered" if "vfio_pci" in modules else "run: modprobe vfio-pci"
    return Check("vfio_pci", Status.FAIL, f"vfio-pci driver is not registered ({hint})", "host.vfio_pci_unavailable")


def check_vfio_container(dev_root: Path) -> Check:
    if (dev_root / "vfio" / "vfio").exists():
        return Check("vfio_container", Status.PASS, f"{dev_root}/vfio/vfio exists")
    return Check(
        "vfio_container", Status.FAIL, f"{dev_root}/vfio/vfio is missing (vfio not loaded?)", "host.no_vfio_device"
    )


def check_iommufd(dev_root: Path) -> Check:
    if (dev_root / "iommu").exists():
        return Check("iommufd", Status.PASS, f"{dev_root}/iommu exists (iommufd available)")
    return Check("iommufd", Status.WARN, f"{dev_root}/iommu is missing: only the legacy VFIO container can be used")


def check_interrupt_remapping(sys_root: Path) -> Check:
    unsafe = _read(sys_root / "module" / "vfio_iommu_type1" / "parameters" / "allow_unsafe_interrupts")
    if unsafe is not None and unsafe.strip() in ("Y", "1"):
        return Check(
            "interrupt_remapping",
            Status.FAIL,
            "vfio_iommu_type1.allow_unsafe_interrupts=Y: guests could inject interrupts into the host",
            "host.unsafe_interrupts",
        )
    units = _listdir(sys_root / "class" / "iommu")
    intel = [u for u in units if (sys_root / "class" / "iommu" / u / "intel-iommu").is_dir()]
    missing = []
    for u in intel:
        ecap = _read(sys_root / "class" / "iommu" / u / "intel-iommu" / "ecap")
        try:
            if ecap is not None and not int(ecap.strip(), 16) & (1 << 3):
                missing.append(u)
        except ValueError:
            continue
    if missing:
        return Check(
            "interrupt_remapping",
            Status.FAIL,
            f"IOMMU units without interrupt remapping (ECAP.IR=0): {', '.join(missing)}",
            "host.no_interrupt_remapping",
        )
    if intel:
        return Check("interrupt_remapping", Status.PASS, f"ECAP.IR set on {', '.join(intel)}")
    return Check("interrupt_remapping", Status.WARN, "not visible in sysfs on this host")


def check_virtualization(sys_root: Path, dev_root: Path, modules: set[str], guest: bool) -> Check:
    if "kvm_pvm" in modules:
        where = " (this machine is itself a VM guest)" if guest else ""
        return Check(
            "virtualization",
            Status.FAIL,
            f"kvm_pvm is loaded: PVM host{where}. PVM cannot pass PCI devices through to a guest; "
            "VFIO passthrough needs hardware KVM (kvm_intel/kvm_amd) on a host with an IOMMU",
            "host.pvm_unsupported",
        )
    hw = sorted(modules & {"kvm_intel", "kvm_amd"})
    if not (dev_root / "kvm").exists():
        return Check("virtualization", Status.FAIL, f"{dev_root}/kvm is missing", "host.no_kvm")
    if hw:
        return Check("virtualization", Status.PASS, f"hardware KVM ({', '.join(hw)})")
    return Check("virtualization", Status.WARN, f"{dev_root}/kvm exists; KVM flavour not visible")


def check_host(
    sys_root: str | os.PathLike[str] = "/sys",
    dev_root: str | os.PathLike[str] = "/dev",
    proc_root: str | os.PathLike[str] = "/proc",
) -> HostReadiness:
    sysp, devp, procp = Path(sys_root), Path(dev_root), Path(proc_root)
    modules = _modules(sysp, procp)
    cpuinfo = _read(procp / "cpuinfo") or ""
    guest = any(line.startswith("flags") and " hypervisor" in line for line in cpuinfo.splitlines())
    cmdline = (_read(procp / "cmdline") or "").split()
    facts: dict[str, Any] = {
        "kernel": (_read(procp / "sys" / "kernel" / "osrelease") or "").strip() or None,
        "cpu_is_vm_guest": guest,
        "iommu_cmdline": [w for w in cmdline if w.split("=")[0] in _IOMMU_PARAMS],
        "kvm_modules": sorted(m for m in modules if m.startswith("kvm")),
        "vfio_modules": sorted(m for m in modules if m.startswith("vfio")),
    }
    checks = (
        check_iommu(sysp),
        check_vfio_pci(sysp, modules),
        check_vfio_container(devp),
        check_iommufd(devp),
        check_interrupt_remapping(sysp),
        check_virtualization(sysp, devp, modules, guest),
    )
    return HostReadiness(checks=checks, facts=facts)


_IOMMU_PARAMS = frozenset(
    {"intel_iommu", "amd_iommu", "iommu", "iommu.passthrough", "iommu.strict", "vfio-pci.ids", "vfio_pci.ids",
     "vfio_iommu_type1.allow_unsafe_interrupts", "pcie_acs_override", "intremap"}
)  # fmt: skip
