"""VFIO passthrough: the reference backend. Works on any `PciHost` (real sysfs, fake tree, simulation)."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

from cubeaccel.backends.base import AttachSpec, Problem
from cubeaccel.host.pci import Holder, HostError, PciFunction, PciHost
from cubeaccel.model.device import AcceleratorClass, DeviceRecord, DiscoveredDevice
from cubeaccel.model.profiles import labels_for
from cubeaccel.model.states import DeviceState

VFIO_DRIVER = "vfio-pci"


class VfioBackend:
    """Discovers accelerators, keeps them bound to vfio-pci, checks groups/holders, resets between tenants."""

    name = "vfio"

    def __init__(self, host: PciHost, allow: Sequence[str] = ("10de:*",)) -> None:
        self.host = host
        self.allow = tuple(a.lower() for a in allow)

    def _allowed(self, f: PciFunction) -> bool:
        vd = f"{f.vendor_id:04x}:{f.device_id:04x}"
        return any(fnmatch.fnmatchcase(vd, pat) for pat in self.allow)

    def _accel_class(self, f: PciFunction) -> AcceleratorClass | None:
        cls = AcceleratorClass.from_pci_class(f.class_code)
        if cls is None and self._allowed(f):
            return AcceleratorClass.ACCELERATOR
        return cls if self._allowed(f) else None

    def discover(self) -> list[DiscoveredDevice]:
        found = []
        for f in self.host.functions():
            cls = self._accel_class(f)
            if cls is None:
                continue
            labels = labels_for(f.vendor_id, f.device_id)
            labels.update(backend=self.name, numa_node=str(f.numa_node), **{"class": cls.value})
            found.append(
                DiscoveredDevice(
                    address=f.address,
                    identity=f.identity,
                    accel_class=cls,
                    backend=self.name,
                    numa_node=f.numa_node,
                    iommu_group=f.iommu_group,
                    driver=f.driver,
                    labels=labels,
                )
            )
        return found

    def prepare_host(self, device: DiscoveredDevice) -> list[Problem]:
        """Host initialization: bind to vfio-pci when the operator selected the device."""
        if device.driver == VFIO_DRIVER:
            return []
        if not self.host.driver_available(VFIO_DRIVER):
            return [Problem("backend.vfio_unavailable", "vfio-pci driver is not available on this host")]
        try:
            self.host.bind(device.address, VFIO_DRIVER)
        except HostError as e:
            return [Problem("backend.bind_failed", e.message)]
        return []

    def _presence(self, device: DeviceRecord) -> tuple[PciFunction | None, list[Problem]]:
        f = self.host.function(device.address)
        if f is None:
            return None, [Problem("host.device_missing", f"no PCI function at {device.address}")]
        if f.identity != device.identity:
            return f, [
                Problem(
                    "host.identity_changed",
                    f"{device.address} is now {f.identity.vendor_device}, was {device.identity.vendor_device}",
                )
            ]
        return f, []

    def _group_problems(self, f: PciFunction) -> list[Problem]:
        if f.iommu_group is None:
            return [Problem("backend.no_iommu_group", f"{f.address} has no IOMMU group")]
        offenders = []
        for member in self.host.iommu_group_members(f.iommu_group):
            if member == f.address:
                continue
            mf = self.host.function(member)
            if mf is None or mf.is_bridge:
                continue
            if mf.driver not in (VFIO_DRIVER, None):
                offenders.append(f"{member}({mf.driver})")
        if offenders:
            return [
                Problem(
                    "backend.iommu_group_not_viable",
                    f"IOMMU group {f.iommu_group} has functions not bound to vfio-pci: {', '.join(offenders)}",
                )
            ]
        return []

    def validate(self, device: DeviceRecord) -> list[Problem]:
        f, problems = self._presence(device)
        if f is None or problems:
            return problems
        if not f.enabled:
            problems.append(Problem("host.device_disabled", f"{f.address} is disabled in sysfs"))
        if f.driver != VFIO_DRIVER:
            problems.append(Problem("backend.wrong_driver", f"{f.address} bound to {f.driver}, not vfio-pci"))
        problems += self._group_problems(f)
        holders = self.holders(device)
        if holders:
            who = ", ".join(f"{h.pid}({h.command})" for h in holders)
            problems.append(Problem("host.device_held", f"{f.address} is held by {who}", hard=False))
        if self.host.config_vendor_id(device.address) == 0xFFFF:
            problems.append(Problem("host.device_not_responding", f"{f.address} config space reads 0xffff"))
        return problems

    def health(self, device: DeviceRecord) -> list[Problem]:
        f, problems = self._presence(device)
        if f is None or problems:
            return problems
        if f.driver != VFIO_DRIVER:
            problems.append(Problem("backend.wrong_driver", f"{f.address} bound to {f.driver}, not vfio-pci"))
        if f.aer_fatal:
            problems.append(Problem("host.aer_fatal", f"{f.address} reported {f.aer_fatal} fatal AER errors"))
        if self.host.config_vendor_id(device.address) == 0xFFFF:
            problems.append(Problem("host.device_not_responding", f"{f.address} config space reads 0xffff"))
        if device.state not in (DeviceState.ATTACHED, DeviceState.PREPARING) and self.holders(device):
            problems.append(Problem("host.unexpected_holder", f"{f.address} is held by a process", hard=False))
        return problems

    def holders(self, device: DeviceRecord) -> list[Holder]:
        return self.host.holders(device.address)

    def cleanup(self, device: DeviceRecord) -> list[Problem]:
        f, problems = self._presence(device)
        if f is None or problems:
            return problems
        try:
            self.host.reset(device.address)
        except HostError as e:
            return [Problem("backend.reset_failed", e.message, hard=False)]
        if self.host.config_vendor_id(device.address) == 0xFFFF:
            return [Problem("backend.reset_failed", f"{device.address} stopped answering after reset", hard=False)]
        _, after = self._presence(device)
        return after

    def attach_spec(self, device: DeviceRecord) -> AttachSpec:
        return AttachSpec(driver=VFIO_DRIVER, properties={"host": str(device.address)})
