"""What a template VM may contain when its state is saved: its own fixed devices, nothing else.

The in-memory record of attached devices is not enough: a device added over the second QMP monitor, or one
the shim lost track of, would be frozen into every sandbox restored from the state. So the saver asks QEMU
(`query-pci`, walking every bridge, and QOM's user-created device lists, which also name a hot-plugged device
the guest has not enumerated yet) and refuses when anything is not part of the template machine.
"""

from __future__ import annotations

from typing import Any

from cubeaccel.protocol.errors import CubeError

# vendor:device of the functions `build_argv` gives a q35 template VM (-nodefaults): host bridge, ICH9 LPC,
# AHCI, SMBus, virtio-serial (legacy and modern ids), pcie-root-port.
TEMPLATE_PCI_IDS = frozenset(
    {
        (0x8086, 0x29C0),
        (0x8086, 0x2918),
        (0x8086, 0x2922),
        (0x8086, 0x2930),
        (0x1AF4, 0x1003),
        (0x1AF4, 0x1043),
        (0x1B36, 0x000C),
    }
)
# QOM types of the template's own `-device` options.
TEMPLATE_QDEV_TYPES = frozenset({"pcie-root-port", "virtio-serial-pci", "virtserialport"})
QOM_DEVICE_PATHS = ("/machine/peripheral", "/machine/peripheral-anon")


def _vd(dev: dict[str, Any]) -> tuple[int, int]:
    ident = dev.get("id") or {}
    return int(ident.get("vendor", -1)), int(ident.get("device", -1))


def _describe(dev: dict[str, Any], why: str, behind: str | None) -> dict[str, Any]:
    vendor, device = _vd(dev)
    return {
        "source": "query-pci",
        "why": why,
        "bus": dev.get("bus"),
        "slot": dev.get("slot"),
        "function": dev.get("function"),
        "vendor_device": f"{vendor & 0xFFFF:04x}:{device & 0xFFFF:04x}",
        "qdev_id": dev.get("qdev_id") or None,
        "behind": behind,
    }


def _walk(devices: list[dict[str, Any]], behind: str | None, out: list[dict[str, Any]]) -> None:
    for dev in devices:
        if behind is not None:
            out.append(_describe(dev, "hot-plugged behind a root port", behind))
        elif _vd(dev) not in TEMPLATE_PCI_IDS:
            out.append(_describe(dev, "vendor:device not in the template machine", None))
        bridge = dev.get("pci_bridge")
        if isinstance(bridge, dict):
            _walk(list(bridge.get("devices") or []), str(dev.get("qdev_id") or f"slot{dev.get('slot')}"), out)


def foreign_pci(query_pci: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Functions in a `query-pci` reply that the template machine does not have. Template root ports are
    always empty, so anything on a bridge's secondary bus is foreign whatever its id."""
    out: list[dict[str, Any]] = []
    for bus in query_pci:
        _walk(list(bus.get("devices") or []), None, out)
    return out


def foreign_qom(path: str, qom_list: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """User-created devices (`qom-list` of /machine/peripheral[-anon]) whose type the template never adds."""
    out = []
    for entry in qom_list:
        kind = str(entry.get("type", ""))
        if kind.startswith("child<") and kind[6:-1] not in TEMPLATE_QDEV_TYPES:
            out.append(
                {
                    "source": "qom",
                    "why": "device type not in the template machine",
                    "path": path,
                    "qdev_id": entry.get("name"),
                    "type": kind[6:-1],
                }
            )
    return out


def snapshot_refused(found: list[dict[str, Any]]) -> CubeError:
    return CubeError(
        "lifecycle.snapshot_with_device",
        "a VM holding a device is never saved as a template state: "
        + ", ".join(sorted({str(f.get("vendor_device") or f.get("type")) for f in found})),
        layer="backend",
        details={"devices": found},
    )
