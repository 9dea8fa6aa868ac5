"""What a confined VMM may see, and the command line that confines it (host/vmm/vmm_launch.py, setpriv, QEMU).

`vmm_exposure` is the one place that decides which host paths exist inside a VMM's mount namespace: a path not
named there does not exist for QEMU. Anything new a VMM must open (a TAP, a scratch disk) is added there.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from cubeaccel.host.vmm import vmm_launch
from cubeaccel.host.vmm.confine import expected_caps
from cubeaccel.shim.vmm import VmConfig

VMM_ROOT_DIR = "vmm-root"  # under the state dir: the mount point of the VMM's own root (empty on the host)
BASE_DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom")


@dataclass(frozen=True)
class VmmExposure:
    """Host paths bound into the VMM's root, at their own paths (so QEMU's argv names them unchanged)."""

    trees_ro: tuple[str, ...] = ("/usr",)
    read_only: tuple[str, ...] = ()
    read_write: tuple[str, ...] = ()
    devices: tuple[str, ...] = BASE_DEVICES
    owned: tuple[Path, ...] = field(default=())  # device nodes chowned to the VMM's uid for its lifetime
    private_nodes: tuple[str, ...] = ()  # shared nodes (/dev/kvm): a copy owned by the VMM's uid in its /dev only

    def config(self, root: Path, uid: int, gid: int, memlock: int | None, memlock_required: bool) -> dict[str, object]:
        return {
            "root": str(root),
            "trees_ro": list(self.trees_ro),
            "read_only": list(self.read_only),
            "read_write": list(self.read_write),
            "devices": list(self.devices),
            "private_nodes": [[p, uid, gid] for p in self.private_nodes],
            "memlock": memlock,
            "memlock_required": memlock_required,
        }


def vfio_group_node(host_address: str, sys_root: Path = Path("/sys"), dev_root: Path = Path("/dev")) -> Path | None:
    """/dev/vfio/N of a PCI function's IOMMU group, or None when it has no group (QEMU then refuses it)."""
    link = sys_root / "bus" / "pci" / "devices" / host_address / "iommu_group"
    try:
        group = link.resolve(strict=True).name
    except OSError:
        return None
    node = dev_root / "vfio" / group
    return node if group.isdigit() and node.exists() else None


def vmm_exposure(
    cfg: VmConfig, accel: str, sys_root: Path = Path("/sys"), dev_root: Path = Path("/dev")
) -> VmmExposure:
    """Everything a VMM may open: QEMU itself (/usr), its kernel and initrd, /dev/null, zero, urandom, /dev/kvm
    under KVM (its own node, owned by its uid), and for VFIO the container, each device's group node (handed to
    the VMM's uid) and sysfs, read-only (QEMU's vfio-pci reads the device's sysfs directory). Sockets, console
    and state files come as descriptors.
    A host path QEMU opens by name for a new device (a shared directory, a disk image) belongs here too."""
    devices = list(BASE_DEVICES)
    trees = ["/usr"]
    owned: list[Path] = []
    private = ("/dev/kvm",) if accel == "kvm" else ()  # root:kvm 0660 on the host, shared by every VMM
    groups = [g for h in cfg.vfio_hosts if (g := vfio_group_node(h, sys_root, dev_root)) is not None]
    if cfg.vfio_hosts:
        trees.append(str(sys_root))
    trees += [source for source, _ in cfg.ro_mounts]  # the sandbox's read-only 9p shares (QEMU opens them by name)
    if groups:
        devices.append(str(dev_root / "vfio" / "vfio"))
    for g in dict.fromkeys(groups):
        devices.append(str(g))
        owned.append(g)
    # A stand-in's device memory file: read-write for this VMM's uid while it lives, root's again at its exit.
    owned += [Path(f) for f in cfg.memory_files]
    return VmmExposure(
        tuple(trees), (str(cfg.kernel), str(cfg.initrd)), cfg.memory_files, tuple(devices), tuple(owned), private
    )


def setpriv_argv(uid: int, gid: int, mode: str) -> list[str]:
    """Drop to uid/gid with no groups; no capabilities at all, or exactly CAP_IPC_LOCK (`cap_ipc_lock` mode:
    kept in every set, the bounding set included, so nothing else can ever be regained)."""
    keep = ",+ipc_lock" if expected_caps(mode) else ""
    return [
        "setpriv",
        f"--reuid={uid}",
        f"--regid={gid}",
        "--clear-groups",
        f"--inh-caps=-all{keep}",
        f"--ambient-caps=-all{keep}",
        f"--bounding-set=-all{keep}",
        "--no-new-privs",
        "--",
    ]


def launch_argv(config_json: str, uid: int, gid: int, mode: str, qemu_argv: list[str]) -> list[str]:
    """launcher (root: namespace, root, limits) → setpriv (credentials) → QEMU (seccomp): one pid throughout."""
    return [sys.executable, "-S", vmm_launch.__file__, config_json, "--", *setpriv_argv(uid, gid, mode), *qemu_argv]
