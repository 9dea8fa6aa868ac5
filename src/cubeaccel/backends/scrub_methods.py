"""The one registry of scrub methods: which device kind is cleared between tenants how (docs/scrub.md).

A scrub method is a vendor and device decision, so it lives here, in backends/, and generic code (Cubelet's scrub
step, the shim's scrub mode) only carries what this table says. A device kind not in the table has no known
method: under policy `trusted-vm` it is refused at host initialization (`host.no_scrub_method`: held, never
bound, never advertised, never written to) until the operator picks a policy for it (`--scrub VVVV:DDDD=none`,
or for its class).

Methods (the agent's `scrub` request, agent/scrub.py):
- `cuda`: NVIDIA GPUs (display and 3D/processing-accelerator classes): every allocatable byte zeroed through
  libcuda, samples read back. Its scrub VM boots the NVIDIA guest image (images/nvidia.py), cold, with enough
  guest memory for that image, in a machine shaped for the device's BARs (model/bars.py).
- `bar` with layout `edu`: QEMU's `edu` (1234:11e8), its tenant-writable BAR0 registers written and read back.
- `bar-memory`: QEMU's `ivshmem-plain` (1af4:1110) over a per-device file (the remanence stand-in): every byte of
  its memory BAR (BAR2, `resource2`) zeroed and read back.
- `vmm-exit`: QEMU's `pci-testdev` (1b36:0005). Its BAR2 (`membar`) has no RAM behind it and its BAR0/BAR1 test
  registers live in the VMM, so everything a tenant could leave in it ends with the tenant's VMM, which the
  release path proves gone. No scrub VM boots; the release evidence records the method.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cubeaccel.backends.nvidia import DISPLAY_CLASS, NVIDIA_VENDOR, PROCESSING_ACCELERATOR_CLASS
from cubeaccel.model.device import DeviceIdentity

NO_METHOD = "host.no_scrub_method"
EDU_KIND = (0x1234, 0x11E8)
IVSHMEM_KIND = (0x1AF4, 0x1110)
TESTDEV_KIND = (0x1B36, 0x0005)
SCRUB_VM_MEMORY_MIB = 256  # the CPU-only scrub image
GPU_SCRUB_VM_MEMORY_MIB = 1024  # the NVIDIA image's initrd unpacks into guest RAM (docs/gpu-image.md: ≥ 1 GiB)


@dataclass(frozen=True)
class ScrubMethod:
    """How one device kind is scrubbed. `name` is the agent's method; `params` go with it unchanged (the shim adds
    the device's guest address); `image_stack` names the vendor guest image the scrub VM boots ("" CPU-only)."""

    name: str
    params: dict[str, str] = field(default_factory=dict)
    image_stack: str = ""
    memory_mib: int = SCRUB_VM_MEMORY_MIB
    start: str | None = None  # None: the node's scrub start mode; "cold": no template snapshot fits this image
    needs_vm: bool = True  # False: nothing outlives the tenant's VMM (`vmm-exit`)
    why: str = ""


CUDA = ScrubMethod(
    "cuda", image_stack="nvidia", memory_mib=GPU_SCRUB_VM_MEMORY_MIB, start="cold", why="device memory via libcuda"
)
EDU_REGISTERS = ScrubMethod("bar", {"layout": "edu"}, why="edu's tenant-writable BAR0 registers")
BAR_MEMORY = ScrubMethod("bar-memory", {"resource": "resource2"}, why="the whole memory BAR, zeroed and read back")
VMM_EXIT = ScrubMethod("vmm-exit", needs_vm=False, why="no memory behind its BARs; its state ends with the VMM")

# (vendor, device) → method; device None: every device of the vendor whose class passes `_CLASS_RULES`.
BY_KIND: dict[tuple[int, int], ScrubMethod] = {
    EDU_KIND: EDU_REGISTERS,
    IVSHMEM_KIND: BAR_MEMORY,
    TESTDEV_KIND: VMM_EXIT,
}
BY_VENDOR_CLASS: dict[int, tuple[tuple[int, ...], ScrubMethod]] = {
    NVIDIA_VENDOR: ((DISPLAY_CLASS, PROCESSING_ACCELERATOR_CLASS), CUDA),
}
AGENT_METHODS = frozenset(m.name for m in (CUDA, EDU_REGISTERS, BAR_MEMORY))


def kind_key(identity: DeviceIdentity) -> str:
    """`vvvv:dddd`, the key an operator's `--scrub` names a device kind by."""
    return f"{identity.vendor_id:04x}:{identity.device_id:04x}"


def method_for(identity: DeviceIdentity) -> ScrubMethod | None:
    """The registered method of this device kind, or None (no known way to clear it: refuse under trusted-vm)."""
    if (m := BY_KIND.get((identity.vendor_id, identity.device_id))) is not None:
        return m
    rule = BY_VENDOR_CLASS.get(identity.vendor_id)
    if rule is not None and identity.class_code >> 16 in rule[0]:
        return rule[1]
    return None


def no_method_message(identity: DeviceIdentity, accel_class: str) -> str:
    return (
        f"no scrub method is known for {kind_key(identity)} (class 0x{identity.class_code:06x}) and its policy is "
        f"trusted-vm: kept out (never bound, written to or advertised) until the operator picks a policy for it, "
        f"e.g. `cubeaccel cubelet serve --scrub {kind_key(identity)}=none` (or --scrub {accel_class}=none) when "
        "the device clears its own memory, or leaves it out of --allow"
    )
