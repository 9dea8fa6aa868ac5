"""The operator's allow-list of devices the VFIO backend may manage, in the spirit of Nova's device spec.

A pattern is `VVVV:DDDD[@ADDRESS]`: vendor and device as 4 hex digits or `*`, and an optional address
glob (`0000:3b:*`). Class still decides: a wildcard pattern only admits display (0x03) and processing
accelerator (0x12) functions, so `10de:*` picks up GPUs but not the NVSwitches (class 0x0680) or the
HDMI audio functions (0x0403) that share the vendor id. An exact `vendor:device` admits that id
whatever its class (e.g. QEMU's `edu` device, class 0x00ff), except bridges, which are never ours.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

from cubeaccel.host.pci.base import PciFunction
from cubeaccel.model.device import AcceleratorClass
from cubeaccel.protocol.errors import invalid

_SPEC = re.compile(r"([0-9a-f]{4}|\*):([0-9a-f]{4}|\*)(?:@([0-9a-f*?:.]{1,12}))?")
MAX_PATTERNS = 64


@dataclass(frozen=True)
class DeviceSpec:
    vendor: str  # 4 hex digits or "*"
    device: str
    address: str | None = None

    @classmethod
    def parse(cls, text: object) -> DeviceSpec:
        if not isinstance(text, str) or len(text) > 32:
            raise invalid("backend.invalid_allow_pattern", f"not a vendor:device[@address] pattern: {text!r}")
        m = _SPEC.fullmatch(text.lower())
        if m is None:
            raise invalid("backend.invalid_allow_pattern", f"not a vendor:device[@address] pattern: {text!r}")
        return cls(m[1], m[2], m[3])

    @property
    def exact(self) -> bool:
        return "*" not in (self.vendor, self.device)

    def matches(self, f: PciFunction) -> bool:
        if self.vendor != "*" and int(self.vendor, 16) != f.vendor_id:
            return False
        if self.device != "*" and int(self.device, 16) != f.device_id:
            return False
        return self.address is None or fnmatch.fnmatchcase(str(f.address), self.address)

    def __str__(self) -> str:
        return f"{self.vendor}:{self.device}" + (f"@{self.address}" if self.address else "")


def parse_allow(patterns: object) -> tuple[DeviceSpec, ...]:
    if isinstance(patterns, str) or not isinstance(patterns, (list, tuple)):
        raise invalid("backend.invalid_allow_pattern", f"allow-list must be a list of patterns: {patterns!r}")
    if len(patterns) > MAX_PATTERNS:
        raise invalid("backend.invalid_allow_pattern", f"at most {MAX_PATTERNS} allow patterns")
    return tuple(DeviceSpec.parse(p) for p in patterns)


def accelerator_class(f: PciFunction, allow: tuple[DeviceSpec, ...]) -> AcceleratorClass | None:
    """The class this function is managed as, or None when it is not ours."""
    if f.is_bridge:
        return None
    by_class = AcceleratorClass.from_pci_class(f.class_code)
    for spec in allow:
        if not spec.matches(f):
            continue
        if by_class is not None:
            return by_class
        if spec.exact:
            return AcceleratorClass.ACCELERATOR
    return None
