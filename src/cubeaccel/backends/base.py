"""Backend protocol: backends describe and act on devices; Cubelet decides (STYLE §5)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from cubeaccel.host.pci import Holder
from cubeaccel.model.device import DeviceRecord, DiscoveredDevice


@dataclass(frozen=True)
class Problem:
    """Why a device is not (or no longer) safe to hand out. `code` becomes the device's reason."""

    code: str
    message: str
    hard: bool = True  # hard → unhealthy; soft → quarantine (safety unproven)


@dataclass(frozen=True)
class AttachSpec:
    """What the VMM needs to attach the device (QMP device_add arguments)."""

    driver: str
    properties: dict[str, str]


class Backend(Protocol):
    name: str

    def readiness(self) -> list[Problem]:
        """Host-wide prerequisites for this backend (VFIO: IOMMU, vfio-pci, no PVM; emulated: QEMU installed).

        Empty when the host can serve the backend at all. Cubelet runs it before it validates or advertises any
        device, and again on every reconcile; codes are `host.*`."""
        ...

    def discover(self) -> list[DiscoveredDevice]:
        """Accelerators this backend would manage on this host, with labels."""
        ...

    def validate(self, device: DeviceRecord) -> list[Problem]:
        """Host prerequisites for handing the device out: present, same identity, driver, group, holders."""
        ...

    def health(self, device: DeviceRecord) -> list[Problem]:
        """Cheap periodic check; empty when healthy."""
        ...

    def holders(self, device: DeviceRecord) -> list[Holder]: ...

    def cleanup(self, device: DeviceRecord) -> list[Problem]:
        """Between tenants: reset and verify. Empty on success."""
        ...

    def attach_spec(self, device: DeviceRecord) -> AttachSpec: ...
