"""NVIDIA-specific host facts for the VFIO backend: NVSwitch fabrics (HGX/DGX baseboards).

On an HGX system the SXM GPUs talk to each other through NVSwitch chips, which appear on the PCI bus as NVIDIA
functions of class 0x0680 ("bridge, other"; 10de:22a3 on HGX H100/H200, 10de:1af1 on HGX A100). Whole-GPU
passthrough there is not the plain VFIO path: NVIDIA's supported models are full passthrough (every GPU and every
NVSwitch into one VM) or shared NVSwitch virtualization, where NVIDIA Fabric Manager in a service VM or on the host
partitions the fabric and must activate a partition before its GPUs are given to a guest. Without that, a guest's
driver finds the GPU but CUDA reports the fabric not ready. This release does not drive Fabric Manager, so GPUs on
such a node are kept out: registered, never bound to vfio-pci, never advertised, each with the reason below.

NVSwitches are recognised by vendor and class, not by a device-id list, so a newer generation is recognised too;
the ids below only name the part in messages. One exception: nForce chipsets (2004-2009 desktop boards) put their
Ethernet function in the same class (10de:0269, 10de:03ef); every NVSwitch id is above 0x1000.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from cubeaccel.backends.base import Problem
from cubeaccel.host.pci.base import PciFunction
from cubeaccel.host.pci.readiness import Check, Status

NVIDIA_VENDOR = 0x10DE
BRIDGE_OTHER = 0x0680  # PCI base class 06 (bridge), subclass 80 (other)
DISPLAY_CLASS = 0x03
PROCESSING_ACCELERATOR_CLASS = 0x12
FABRIC_CODE = "backend.nvswitch_fabric_unmanaged"
# For messages only: recognition is by vendor + class.
NVSWITCH_PARTS = {0x1AF1: "NVSwitch gen2, HGX A100", 0x22A3: "NVSwitch gen3, HGX H100/H200"}
CHIPSET_IDS_BELOW = 0x1000  # nForce MCP functions share the class; no NVSwitch id is this low
WHAT_TO_DO = (
    "to use them with cubeaccel, run GPU sandboxes on nodes whose GPUs are not on an NVSwitch fabric (PCIe GPUs); "
    "this node's GPUs can serve a stack that manages Fabric Manager partitions meanwhile, and leaving 10de:* out of "
    "this Cubelet's --allow list removes them from its inventory"
)


# The reset ladder's vendor fact (model/reset_ladder.py, `prefer_bus`). Production finding (dstack, 2026): after a
# VMM was killed mid-init, a function-level reset did not clear an H200's firmware (GSP) session state — the next
# driver load failed — where a secondary bus reset did. So after an unclean VMM exit an NVIDIA GPU starts at the bus
# rung (still only when every function that reset reaches is in its own IOMMU group and idle; else FLR). After a
# clean exit FLR is enough and cheaper.
BUS_RESET_AFTER_UNCLEAN_EXIT_WHY = (
    "NVIDIA: FLR did not clear an H200's firmware state after a VMM was killed mid-init, a secondary bus reset did"
)


def prefers_bus_reset(f: PciFunction, unclean_exit: bool) -> bool:
    """Whether the reset ladder should start at the bus rung for this function."""
    return unclean_exit and is_nvidia_gpu(f)


def is_nvswitch(f: PciFunction) -> bool:
    return f.vendor_id == NVIDIA_VENDOR and f.class_code >> 8 == BRIDGE_OTHER and f.device_id >= CHIPSET_IDS_BELOW


def is_nvidia_gpu(f: PciFunction) -> bool:
    return f.vendor_id == NVIDIA_VENDOR and f.class_code >> 16 in (DISPLAY_CLASS, PROCESSING_ACCELERATOR_CLASS)


@dataclass(frozen=True)
class Fabric:
    """The NVSwitch functions of a host and the NVIDIA GPUs on it (empty switches: no fabric)."""

    switches: tuple[PciFunction, ...]
    gpus: tuple[PciFunction, ...]

    @classmethod
    def of(cls, functions: Iterable[PciFunction]) -> Fabric:
        fs = list(functions)
        return cls(tuple(f for f in fs if is_nvswitch(f)), tuple(f for f in fs if is_nvidia_gpu(f)))

    @property
    def present(self) -> bool:
        return bool(self.switches)

    def describe(self) -> str:
        parts = sorted({NVSWITCH_PARTS.get(f.device_id, f"NVSwitch 10de:{f.device_id:04x}") for f in self.switches})
        return f"{len(self.switches)} NVSwitch function(s) ({', '.join(parts)})"

    def message(self) -> str:
        return (
            f"this is an NVSwitch (HGX) system: {self.describe()} beside {len(self.gpus)} NVIDIA GPU(s). Whole-GPU "
            "passthrough here needs NVIDIA Fabric Manager partitions (shared NVSwitch virtualization), which this "
            f"release does not manage, so these GPUs are kept out (not bound to vfio-pci, not advertised); {WHAT_TO_DO}"
        )

    def problem(self, f: PciFunction) -> Problem | None:
        """The reason an NVIDIA GPU on this host is kept out (None: it is not, or there is no fabric)."""
        if not self.present or not is_nvidia_gpu(f):
            return None
        return Problem(FABRIC_CODE, f"{f.address}: {self.message()}", hard=False, held=True)

    def facts(self) -> dict[str, object]:
        return {
            "nvswitch_functions": [str(f.address) for f in self.switches],
            "nvswitch_device_ids": sorted({f"10de:{f.device_id:04x}" for f in self.switches}),
            "nvidia_gpus": len(self.gpus),
        }


def fabric_check(functions: Iterable[PciFunction]) -> Check:
    """`cubeaccel host check`'s line: a warning, not a failure, since the host can still pass other devices
    through; its GPUs are what is kept out."""
    fabric = Fabric.of(functions)
    if not fabric.present:
        return Check("nvswitch", Status.PASS, "no NVSwitch functions: GPUs are passed through one by one")
    return Check("nvswitch", Status.WARN, fabric.message(), FABRIC_CODE)
