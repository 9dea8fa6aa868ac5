"""PCI host boundary: what the kernel tells us about PCI functions, and the few writes we make.

`PciHost` is implemented by `host.pci.sysfs.SysfsPciHost` (real /sys, or a fake tree on disk) and by
`host.pci.simulated.SimulatedPciHost` (in-memory kernel model with fault injection). Backends only see this protocol;
both implementations import this module, never the other way round.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from cubeaccel.model.bars import Bar
from cubeaccel.model.device import DeviceIdentity, PciAddress
from cubeaccel.protocol.errors import CubeError


class HostError(CubeError):
    """A host operation failed (bind, reset, read). Layer `host_hardware` unless stated."""


def host_error(code: str, message: str, **details: object) -> HostError:
    return HostError(code=code, message=message, layer="host_hardware", details=dict(details), status=500)


@dataclass(frozen=True)
class Holder:
    """A process holding a device file open (`/dev/vfio/<group>`, `/dev/nvidia0`, ...)."""

    pid: int
    command: str
    path: str
    unknown: bool = False  # the process's fds could not be read: it may hold the device (fail closed)


@dataclass(frozen=True)
class PciFunction:
    """One PCI function as sysfs describes it. Optional fields are absent on some kernels/devices."""

    address: PciAddress
    vendor_id: int
    device_id: int
    subsystem_vendor_id: int = 0
    subsystem_device_id: int = 0
    class_code: int = 0
    revision: int = 0
    numa_node: int = -1
    iommu_group: int | None = None
    driver: str | None = None
    driver_override: str | None = None
    bars: tuple[Bar, ...] = ()
    link_speed: str | None = None
    link_width: str | None = None
    sriov_totalvfs: int | None = None
    sriov_numvfs: int | None = None
    reset_method: tuple[str, ...] = ()
    aer_fatal: int | None = None
    aer_nonfatal: int | None = None
    enabled: bool = True
    serial: str | None = None
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def identity(self) -> DeviceIdentity:
        return DeviceIdentity(
            vendor_id=self.vendor_id,
            device_id=self.device_id,
            subsystem_vendor_id=self.subsystem_vendor_id,
            subsystem_device_id=self.subsystem_device_id,
            class_code=self.class_code,
            revision=self.revision,
            serial=self.serial,
            bars=self.bars,
        )

    @property
    def is_bridge(self) -> bool:
        return (self.class_code >> 16) == 0x06


class PciHost(Protocol):
    """What backends may ask of a host. Every address is a validated `PciAddress`."""

    def functions(self) -> list[PciFunction]: ...

    def function(self, address: PciAddress) -> PciFunction | None: ...

    def iommu_group_members(self, group: int) -> list[PciAddress]: ...

    def bind(self, address: PciAddress, driver: str) -> None:
        """driver_override + unbind + drivers_probe (never new_id)."""
        ...

    def reset(self, address: PciAddress, methods: tuple[str, ...] = ()) -> None:
        """A reset through the `reset` attribute, limited to the kernel `methods` named (a rung of the reset
        ladder; () lets the kernel pick); raises HostError on failure."""
        ...

    def config_vendor_id(self, address: PciAddress) -> int:
        """Vendor id read from config space (0xffff when the device no longer answers)."""
        ...

    def holders(self, address: PciAddress) -> list[Holder]:
        """Processes holding this function's device files open."""
        ...

    def driver_available(self, driver: str) -> bool: ...


@runtime_checkable
class SupportsRestore(Protocol):
    """Hosts that can undo `bind`: clear driver_override, unbind, hand back to `driver` (None: leave unbound).

    Separate from `PciHost` so existing hosts keep satisfying it; the VFIO backend checks for it.
    """

    def restore_driver(self, address: PciAddress, driver: str | None) -> None: ...


@runtime_checkable
class SupportsBusReach(Protocol):
    """Hosts that can say which functions a secondary bus reset of a function's bus would reach (sysfs topology)."""

    def bus_reach(self, address: PciAddress) -> list[PciAddress] | None:
        """Every function under the bridge above `address`, itself included; None on a root bus."""
        ...


def function_json(f: PciFunction) -> dict[str, Any]:
    return {
        "address": str(f.address),
        "vendor_device": f.identity.vendor_device,
        "subsystem": f"{f.subsystem_vendor_id:04x}:{f.subsystem_device_id:04x}",
        "class": f"{f.class_code:06x}",
        "revision": f"{f.revision:02x}",
        "numa_node": f.numa_node,
        "iommu_group": f.iommu_group,
        "driver": f.driver,
        "driver_override": f.driver_override,
        "bars": [b.to_json() for b in f.bars],
        "link": {"speed": f.link_speed, "width": f.link_width},
        "sriov": {"totalvfs": f.sriov_totalvfs, "numvfs": f.sriov_numvfs},
        "reset_method": list(f.reset_method),
        "aer": {"fatal": f.aer_fatal, "nonfatal": f.aer_nonfatal},
        "enabled": f.enabled,
        "serial": f.serial,
        "extra": dict(f.extra),
    }
