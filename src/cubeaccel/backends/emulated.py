"""QEMU's emulated devices as stand-in accelerators on hosts without GPUs or an IOMMU: `edu` (1234:11e8, a
driverless function with a 1 MiB BAR) and, GPU-shaped, `pci-testdev,membar=SIZE` (1b36:0005, whose BAR2 is a
64-bit prefetchable BAR of SIZE with no RAM behind it, as large as a GPU's memory aperture).

The same lifecycle as VFIO, with the host side made of VMM processes instead of device files: each slot is a
virtual device with a synthetic address (0000:e0:SS.0) that exists only inside the VMM it is hot-plugged into.
Holders are live VMM processes found in /proc by their tag and device list (never an in-memory record), so
Cubelet's release rule — "no holder remains" — means exactly "no VMM that could still have it is alive".

The slot addresses are the same for every Cubelet, so the device id carries the Cubelet's instance id
(`emulated-<instance>-0000:e0:00.0`, persisted in its state dir): the id is what the VMM's environment lists, so
two Cubelets (or two test runs) on one host never count each other's VMMs as holders.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from cubeaccel.backends.base import AttachSpec, Problem
from cubeaccel.host.pci.base import Holder
from cubeaccel.host.vmm.hypervisor import find_qemu
from cubeaccel.host.vmm.vmmproc import vmm_processes
from cubeaccel.model.bars import Bar, BarKind, is_bar_size
from cubeaccel.model.device import (
    AcceleratorClass,
    DeviceIdentity,
    DeviceRecord,
    DiscoveredDevice,
    PciAddress,
    device_id_for,
)
from cubeaccel.model.profiles import labels_for
from cubeaccel.model.states import DeviceState

EDU_VENDOR, EDU_DEVICE = 0x1234, 0x11E8
EDU_BARS = (Bar(0, 1 << 20, BarKind.MEM32),)
EDU_IDENTITY = DeviceIdentity(
    vendor_id=EDU_VENDOR,
    device_id=EDU_DEVICE,
    subsystem_vendor_id=0x1AF4,
    subsystem_device_id=0x1100,
    class_code=0x00FF00,
    revision=0x10,
    bars=EDU_BARS,
)
TESTDEV_VENDOR, TESTDEV_DEVICE = 0x1B36, 0x0005
IVSHMEM_VENDOR, IVSHMEM_DEVICE = 0x1AF4, 0x1110
IVSHMEM_REGISTERS = 256  # BAR0: ivshmem's interrupt/doorbell registers (unused by ivshmem-plain)
DEFAULT_MEMORY_FILE = 2 << 20


def ivshmem_identity(size: int) -> DeviceIdentity:
    """QEMU's ivshmem-plain (hw/misc/ivshmem.c): class RAM memory, BAR0 registers, BAR2 the shared memory."""
    return DeviceIdentity(
        vendor_id=IVSHMEM_VENDOR,
        device_id=IVSHMEM_DEVICE,
        subsystem_vendor_id=0x1AF4,
        subsystem_device_id=0x1100,
        class_code=0x050000,
        revision=0x01,
        bars=(Bar(0, IVSHMEM_REGISTERS, BarKind.MEM32), Bar(2, size, BarKind.MEM64, prefetch=True)),
    )


def pci_testdev_identity(membar: int) -> DeviceIdentity:
    """pci-testdev's own BAR0 and I/O BAR1 (QEMU hw/misc/pci-testdev.c), and BAR2 of `membar` bytes."""
    return DeviceIdentity(
        vendor_id=TESTDEV_VENDOR,
        device_id=TESTDEV_DEVICE,
        subsystem_vendor_id=0x1AF4,
        subsystem_device_id=0x1100,
        class_code=0x00FF00,
        bars=(Bar(0, 4096, BarKind.MEM32), Bar(1, 256, BarKind.IO), Bar(2, membar, BarKind.MEM64, prefetch=True)),
    )


INSTANCE_RE = re.compile(r"[a-z0-9]{1,32}")
EMULATED_BUS = 0xE0  # no real bus uses it on our hosts; makes emulated ids obvious in listings


def slot_address(index: int) -> PciAddress:
    return PciAddress(0, EMULATED_BUS, index, 0)


class EmulatedBackend:
    """`slots` virtual edu devices, then one pci-testdev per size in `testdev_membars` (bytes, powers of two).
    QEMU must be installed for them to be handed out."""

    name = "emulated"

    def __init__(
        self,
        instance: str,
        slots: int = 2,
        proc_root: Path = Path("/proc"),
        qemu: str | None = None,
        vmm_root: Path | None = None,
        uid: int | None = None,
        vmm_uids: range = range(0),
        testdev_membars: tuple[int, ...] = (),
        memory_devices: tuple[int, ...] = (),
        memory_dir: Path | None = None,
    ) -> None:
        """`vmm_root` (the Cubelet's shims directory) and `uid` (the Cubelet's) tie a holder to evidence: a
        process counts only when its own files lie under `vmm_root` and it runs as `uid` or as one of the confined
        VMMs' uids (`vmm_uids`, host/vmm/confine.py: no local user runs as those). A tag and a device
        list in an environment are words anyone can write; a local user's or another Cubelet's process that
        copies them must not quarantine this Cubelet's devices. The runtime always passes both."""
        """`memory_devices` (bytes each, powers of two, 4 KiB..64 MiB): ivshmem-plain stand-ins whose memory is a
        file of their own under `memory_dir`, kept across sandboxes: device memory that remembers its tenants."""
        if not 0 < slots + len(testdev_membars) + len(memory_devices) <= 32 or slots < 0:
            raise ValueError("slots must be 1..32")
        if not all(is_bar_size(m) for m in testdev_membars):
            raise ValueError("a pci-testdev BAR size must be a power of two up to 2^48 bytes")
        if not INSTANCE_RE.fullmatch(instance):
            raise ValueError(f"instance must match {INSTANCE_RE.pattern}, not {instance!r}")
        self.instance = instance
        self.slots = slots
        if not all(is_bar_size(m) and 4096 <= m <= 64 << 20 for m in memory_devices):
            raise ValueError("a memory stand-in's size must be a power of two, 4 KiB to 64 MiB")
        if memory_devices and memory_dir is None:
            raise ValueError("memory stand-ins need a memory_dir for their files")
        self.memory_dir = memory_dir
        self.identities = (
            (EDU_IDENTITY,) * slots
            + tuple(pci_testdev_identity(m) for m in testdev_membars)
            + tuple(ivshmem_identity(m) for m in memory_devices)
        )
        self.proc_root = proc_root
        self.qemu = qemu or find_qemu()
        self.vmm_root = vmm_root
        self.uid = uid
        self.vmm_uids = vmm_uids

    def _addresses(self) -> list[PciAddress]:
        return [slot_address(i) for i in range(len(self.identities))]

    def _identity(self, address: PciAddress) -> DeviceIdentity:
        return self.identities[address.slot]

    def device_id(self, index: int) -> str:
        return device_id_for(self.name, slot_address(index), self.instance)

    def discover(self) -> list[DiscoveredDevice]:
        out = []
        for addr in self._addresses():
            identity = self._identity(addr)
            labels = labels_for(identity.vendor_id, identity.device_id)
            labels.update(backend=self.name, numa_node="0", **{"class": AcceleratorClass.ACCELERATOR.value})
            out.append(
                DiscoveredDevice(
                    address=addr,
                    identity=identity,
                    accel_class=AcceleratorClass.ACCELERATOR,
                    backend=self.name,
                    numa_node=0,
                    iommu_group=None,
                    driver=None,
                    labels=labels,
                    instance=self.instance,
                )
            )
        return out

    def readiness(self) -> list[Problem]:
        """QEMU installed is all an emulated device needs: no IOMMU, no KVM (TCG runs anywhere)."""
        if self.qemu is None or not Path(self.qemu).exists():
            return [
                Problem(
                    "host.qemu_missing",
                    "qemu-system-x86_64 is not installed on this host (apt-get install qemu-system-x86)",
                )
            ]
        return []

    def _presence(self, device: DeviceRecord) -> list[Problem]:
        problems = []
        if self.qemu is None or not Path(self.qemu).exists():
            problems.append(Problem("backend.qemu_missing", "qemu-system-x86_64 is not installed on this host"))
        if device.address not in self._addresses() or device.id != device_id_for(
            self.name, device.address, self.instance
        ):
            problems.append(Problem("host.device_missing", f"no emulated slot {device.id} in instance {self.instance}"))
        elif device.identity != (want := self._identity(device.address)) or device.identity.bars not in ((), want.bars):
            problems.append(
                Problem(
                    "host.identity_changed",
                    f"{device.address} is {want.vendor_device} with BARs {[b.name for b in want.bars]}, record says "
                    f"{device.identity.vendor_device} with {[b.name for b in device.identity.bars]}",
                )
            )
        return problems

    def validate(self, device: DeviceRecord) -> list[Problem]:
        problems = self._presence(device)
        held = self.holders(device)
        if held:
            who = ", ".join(f"{h.pid}({h.path})" for h in held)
            problems.append(Problem("host.device_held", f"{device.address} may be held by VMM {who}", hard=False))
        return problems

    def health(self, device: DeviceRecord) -> list[Problem]:
        problems = self._presence(device)
        if device.state not in (DeviceState.ATTACHED, DeviceState.PREPARING) and self.holders(device):
            problems.append(Problem("host.unexpected_holder", f"{device.address} is in a live VMM", hard=False))
        return problems

    def holders(self, device: DeviceRecord) -> list[Holder]:
        """Live VMMs whose environment (read in /proc) lists this device's id — which names this instance."""
        return [
            Holder(p.pid, p.command, f"vmm:{p.sandbox_id}")
            for p in vmm_processes(self.proc_root)
            if device.id in p.device_ids
            and (self.vmm_root is None or p.under(self.vmm_root))
            and (self.uid is None or p.uid == self.uid or (p.uid is not None and p.uid in self.vmm_uids))
        ]

    def cleanup(self, device: DeviceRecord) -> list[Problem]:
        """An emulated device dies with its VMM: cleanup is proving the VMM is gone."""
        held = self.holders(device)
        if held:
            return [
                Problem(
                    "backend.vmm_still_running",
                    f"{device.address} still in VMM pid {', '.join(str(h.pid) for h in held)}",
                    hard=False,
                )
            ]
        return []

    def memory_file(self, device: DeviceRecord) -> Path:
        assert self.memory_dir is not None
        return self.memory_dir / f"{device.id.replace(':', '_')}.mem"

    def attach_spec(self, device: DeviceRecord) -> AttachSpec:
        if device.identity.vendor_id == IVSHMEM_VENDOR:
            size = next(b.size for b in device.identity.bars if b.index == 2)
            path = self.memory_file(device)
            if not path.exists():  # the device's memory, made once and kept: what one tenant leaves, the next finds
                self.memory_dir.mkdir(parents=True, exist_ok=True)  # type: ignore[union-attr]
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                try:
                    os.ftruncate(fd, size)
                finally:
                    os.close(fd)
            return AttachSpec(driver="ivshmem-plain", properties={}, memory_file=(str(path), size))
        if device.identity.vendor_id == TESTDEV_VENDOR:
            membar = next(b.size for b in device.identity.bars if b.index == 2)
            return AttachSpec(driver="pci-testdev", properties={"membar": str(membar)})
        return AttachSpec(driver="edu", properties={})
