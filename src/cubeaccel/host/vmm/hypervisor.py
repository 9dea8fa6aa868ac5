"""What this host offers for running MicroVMs: the QEMU binary, whether KVM can run a stock guest, and so how
devices reach a running guest.

Here, not in the shim, because three callers need the answers without driving a VMM: the shim (to start one),
the Cubelet (to advertise hot-plug paths) and `cubeaccel up` (to choose a backend).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from cubeaccel.model.node_facts import HOTPLUG_PCIE_ROOT_PORT_ACPI


def find_qemu() -> str | None:
    """`CUBEACCEL_QEMU`, else qemu-system-x86_64 on PATH; None when neither exists."""
    return os.environ.get("CUBEACCEL_QEMU") or shutil.which("qemu-system-x86_64")


def hotplug_paths() -> tuple[str, ...]:
    """How this node's VMM attaches devices to a running guest: ACPI hot-plug into a `pcie-root-port`, when QEMU
    is installed (the shim's only attach path; cold-plug at VM start is not implemented)."""
    return (HOTPLUG_PCIE_ROOT_PORT_ACPI,) if find_qemu() else ()


def detect_accel(dev: Path = Path("/dev/kvm"), sys_module: Path = Path("/sys/module")) -> tuple[str, str]:
    """("kvm"|"tcg", why). KVM only when it can run a stock guest: PVM's /dev/kvm (kvm_pvm) cannot.

    Modules are read from /sys/module (present for built-in modules too, unlike /proc/modules).
    `CUBEACCEL_ACCEL=tcg|kvm` overrides (an operator who knows better, or tests).
    """
    forced = os.environ.get("CUBEACCEL_ACCEL")
    if forced in ("tcg", "kvm"):
        return forced, f"forced by CUBEACCEL_ACCEL={forced}"
    if not dev.exists():
        return "tcg", f"{dev} does not exist"
    if (sys_module / "kvm_pvm").exists():
        return "tcg", "KVM here is kvm_pvm (this host is itself a nested PVM guest): it cannot run a stock kernel"
    if not os.access(dev, os.R_OK | os.W_OK):
        return "tcg", f"{dev} is not accessible to this user"
    hw = sorted(m for m in ("kvm_intel", "kvm_amd") if (sys_module / m).exists())
    if hw:
        return "kvm", f"hardware KVM ({', '.join(hw)})"
    return "tcg", "neither kvm_intel nor kvm_amd is loaded"


def host_phys_bits(cpuinfo: Path = Path("/proc/cpuinfo")) -> int | None:
    """The CPU's physical address width (`address sizes : 46 bits physical, ...`): under KVM a guest's addresses,
    and so the BARs it can place, can reach no further. None when the kernel does not say."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "address sizes":
            words = value.split()
            return int(words[0]) if words and words[0].isdigit() else None
    return None


def host_cpus() -> int:
    """CPUs this process may run on (its affinity, not the machine's count): what a preallocation pool gets."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except OSError:
        return max(1, os.cpu_count() or 1)


def numa_nodes(sys_root: Path = Path("/sys")) -> tuple[int, ...]:
    """The host's online NUMA nodes (one, `(0,)`, on a machine without NUMA)."""
    base = sys_root / "devices" / "system" / "node"
    found = sorted(int(p.name[4:]) for p in base.glob("node[0-9]*") if p.name[4:].isdigit())
    return tuple(found) or (0,)
