"""The guest checks every GPU sandbox gets, with or without a contract (issue #10: no sandbox skips validation).

Without a contract nothing is known about the guest's drivers, so the minimum is what the host itself knows:
each reserved device is visible in the guest's PCI tree with its own vendor:device, at the guest address the
shim saw it appear at after hot-plug. (The expected driver is known only from a contract, whose
`kernel_driver` layer `check_guest` judges.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from cubeaccel.model.device import DeviceRecord
from cubeaccel.model.violations import ContractViolation, Layer
from cubeaccel.protocol.reports import GuestPciDevice, GuestReport


def _ids(entry: object) -> tuple[str, str, str] | None:
    if not isinstance(entry, GuestPciDevice):
        return None
    address, vendor, device = entry.address, entry.vendor_id, entry.device_id
    if address is None or vendor is None or device is None:
        return None
    return address, vendor.lower(), device.lower()


def check_minimal(
    devices: Sequence[DeviceRecord], guest_addresses: Mapping[str, str], report: GuestReport
) -> list[ContractViolation]:
    seen = [
        ids
        for e in (report.pci_devices if isinstance(report.pci_devices, tuple | list) else ())
        if (ids := _ids(e)) is not None
    ]
    out = []
    for d in devices:
        want = (f"{d.identity.vendor_id:04x}", f"{d.identity.device_id:04x}")
        address = guest_addresses.get(d.id)
        where = [a for a, v, i in seen if (v, i) == want]
        if not where or (address is not None and address not in where):
            expected = f"PCI device {want[0]}:{want[1]}" + (f" at {address}" if address else "")
            found = ", ".join(f"{v}:{i}@{a}" for a, v, i in seen) or "no PCI devices"
            out.append(
                ContractViolation(
                    Layer.HOST_HARDWARE,
                    "compat.device_not_visible_in_guest",
                    expected,
                    found,
                    "the device the host hot-plugged is not where the guest should see it",
                )
            )
    return out
