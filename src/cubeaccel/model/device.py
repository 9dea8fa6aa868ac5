"""Device identity: validated PCI addresses, ids, labels, and the persisted device record."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from cubeaccel.model.bars import Bar
from cubeaccel.model.states import DeviceState
from cubeaccel.protocol.errors import invalid

_BDF = re.compile(r"([0-9a-f]{4}):([0-9a-f]{2}):([01][0-9a-f])\.([0-7])")
_HEX16 = re.compile(r"(?:0x)?([0-9a-f]{4})")


@dataclass(frozen=True, order=True)
class PciAddress:
    """A PCI function address `DDDD:BB:DD.F`.

    Parsed strictly (full match, no whitespace, no path characters) because it is the only
    user-influenced string that ever reaches a sysfs path.
    """

    domain: int
    bus: int
    slot: int
    function: int

    @classmethod
    def parse(cls, text: object) -> PciAddress:
        if not isinstance(text, str) or len(text) != 12:
            raise invalid("device.invalid_address", f"not a PCI address (DDDD:BB:DD.F): {text!r}")
        m = _BDF.fullmatch(text.lower())
        if m is None:
            raise invalid("device.invalid_address", f"not a PCI address (DDDD:BB:DD.F): {text!r}")
        return cls(int(m[1], 16), int(m[2], 16), int(m[3], 16), int(m[4], 16))

    def __post_init__(self) -> None:
        ok = 0 <= self.domain <= 0xFFFF and 0 <= self.bus <= 0xFF and 0 <= self.slot <= 0x1F and 0 <= self.function <= 7
        if not ok:
            raise invalid("device.invalid_address", f"PCI address out of range: {self!r}")

    def __str__(self) -> str:
        return f"{self.domain:04x}:{self.bus:02x}:{self.slot:02x}.{self.function:x}"


def parse_hex_id(text: str) -> int:
    """A 16-bit PCI id as sysfs prints it (`0x10de`) or as operators type it (`10de`)."""
    m = _HEX16.fullmatch(text.strip().lower())
    if m is None:
        raise invalid("device.invalid_id", f"not a 16-bit hex PCI id: {text!r}")
    return int(m[1], 16)


class AcceleratorClass(StrEnum):
    GPU = "gpu"
    ACCELERATOR = "accelerator"  # processing accelerators (class 0x12), TPU/XPU-like

    @classmethod
    def from_pci_class(cls, class_code: int) -> AcceleratorClass | None:
        """Display (0x03) → gpu; processing accelerator (0x12) → accelerator; else not ours."""
        base = (class_code >> 16) & 0xFF
        if base == 0x03:
            return cls.GPU
        if base == 0x12:
            return cls.ACCELERATOR
        return None


@dataclass(frozen=True)
class DeviceIdentity:
    """What must not change for a device to be 'the same device' across restarts and resets.

    `bars` (read from sysfs `resource` at discovery) ride with the identity, stored once with it, but do not
    decide sameness: a record written before they were read has none, and that is not a different card."""

    vendor_id: int
    device_id: int
    subsystem_vendor_id: int = 0
    subsystem_device_id: int = 0
    class_code: int = 0
    revision: int = 0
    serial: str | None = None
    bars: tuple[Bar, ...] = field(default=(), compare=False)

    @property
    def vendor_device(self) -> str:
        return f"{self.vendor_id:04x}:{self.device_id:04x}"

    def to_json(self) -> dict[str, object]:
        return {
            "vendor_id": f"{self.vendor_id:04x}",
            "device_id": f"{self.device_id:04x}",
            "subsystem_vendor_id": f"{self.subsystem_vendor_id:04x}",
            "subsystem_device_id": f"{self.subsystem_device_id:04x}",
            "class_code": f"{self.class_code:06x}",
            "revision": f"{self.revision:02x}",
            "serial": self.serial,
            "bars": [b.to_json() for b in self.bars],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DeviceIdentity:
        return cls(
            vendor_id=int(data["vendor_id"], 16),
            device_id=int(data["device_id"], 16),
            subsystem_vendor_id=int(data.get("subsystem_vendor_id", "0"), 16),
            subsystem_device_id=int(data.get("subsystem_device_id", "0"), 16),
            class_code=int(data.get("class_code", "0"), 16),
            revision=int(data.get("revision", "0"), 16),
            serial=data.get("serial"),
            bars=tuple(Bar.from_json(b) for b in data.get("bars") or ()),
        )


@dataclass(frozen=True)
class DiscoveredDevice:
    """What a backend reports about one accelerator; Cubelet reconciles it against the store."""

    address: PciAddress
    identity: DeviceIdentity
    accel_class: AcceleratorClass
    backend: str
    numa_node: int
    iommu_group: int | None
    driver: str | None
    labels: dict[str, str] = field(default_factory=dict)
    # The Cubelet instance a device exists for, where its address is synthetic (emulated devices live only in
    # that Cubelet's VMMs): two Cubelets on one host then never share a device id. Empty for host devices.
    instance: str = ""

    @property
    def device_id(self) -> str:
        return device_id_for(self.backend, self.address, self.instance)


def device_id_for(backend: str, address: PciAddress, instance: str = "") -> str:
    """Stable id: backend (+ owning instance) + address. Identity is checked separately, so a swapped card is
    detected."""
    return f"{backend}-{instance}-{address}" if instance else f"{backend}-{address}"


@dataclass(frozen=True)
class DeviceRecord:
    """One row of the Cubelet store, as the rest of the code sees it."""

    id: str
    address: PciAddress
    identity: DeviceIdentity
    accel_class: AcceleratorClass
    backend: str
    numa_node: int
    iommu_group: int | None
    expected_driver: str | None
    labels: dict[str, str]
    state: DeviceState
    generation: int
    reason: str | None
    sandbox_id: str | None
    updated_at: float
