"""Pure parsers for the text and bytes sysfs hands back. No I/O, so Hypothesis can hammer them.

Each parser accepts exactly what the kernel prints and returns None (or an empty value) for anything
else: a value we cannot parse is a fact we do not have, never a guess.
"""

from __future__ import annotations

import re

from cubeaccel.protocol.errors import invalid

# Kernel driver names are identifiers plus '-' and '.' in practice (vfio-pci, virtio-pci, nvidia,
# 8250_lpss). Anything else is not a driver name and never reaches a path.
_DRIVER = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")
_HEX = re.compile(r"0x([0-9a-f]{1,8})")


def valid_driver_name(name: object) -> str:
    """Validate a driver name before it is joined into `bus/pci/drivers/<name>` or written anywhere."""
    if not isinstance(name, str) or _DRIVER.fullmatch(name) is None or name in (".", ".."):
        raise invalid("host.invalid_driver_name", f"not a kernel driver name: {name!r}")
    return name


def is_driver_name(name: str) -> bool:
    return _DRIVER.fullmatch(name) is not None and name not in (".", "..")


def driver_from_link(name: str | None) -> str | None:
    """The bound driver's name from the `driver` link, kept even when odd so it still counts as bound.

    An odd name is reported (printable, length-limited) but `valid_driver_name` keeps it out of paths.
    """
    if name is None:
        return None
    return "".join(c if c.isprintable() else "?" for c in name)[:64] or "?"


def parse_hex(text: str | None) -> int | None:
    """`0x10de\\n` → 0x10de. sysfs always prints these with a 0x prefix."""
    if text is None:
        return None
    m = _HEX.fullmatch(text.strip().lower())
    return int(m[1], 16) if m else None


def parse_int(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text.strip(), 10)
    except ValueError:
        return None


def parse_driver_override(text: str | None) -> str | None:
    """The kernel prints `(null)` when no override is set."""
    if text is None:
        return None
    value = text.strip()
    if not value or value == "(null)":
        return None
    return value


def parse_reset_method(text: str | None) -> tuple[str, ...]:
    """`flr bus` → ("flr", "bus"). Absent or empty → (): the kernel then has no `reset` attribute."""
    if text is None:
        return ()
    return tuple(w for w in text.split() if re.fullmatch(r"[a-z_]{1,32}", w))


def parse_aer_total(text: str | None, key: str) -> int | None:
    """AER counters (`aer_dev_fatal`): lines `<Name> <count>` ending with `TOTAL_ERR_FATAL <n>`."""
    if text is None:
        return None
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key:
            return parse_int(parts[1])
    return None


def parse_config_vendor(data: bytes) -> int:
    """Vendor id from the first two bytes of config space (little-endian). Short read → 0xffff."""
    if len(data) < 2:
        return 0xFFFF
    return int.from_bytes(data[:2], "little")


def parse_config_serial(data: bytes) -> str | None:
    """Device Serial Number from the PCIe extended capability list (cap id 0x0003), if exposed.

    Extended capabilities start at 0x100; each header is `id:16 | version:4 | next:12`. Unprivileged
    readers only get 64 bytes of config space, and then there is no serial to report.
    """
    offset, seen = 0x100, 0
    while 0x100 <= offset <= len(data) - 12 and seen < 64:
        header = int.from_bytes(data[offset : offset + 4], "little")
        if header in (0, 0xFFFFFFFF):
            return None
        if header & 0xFFFF == 0x0003:
            low = int.from_bytes(data[offset + 4 : offset + 8], "little")
            high = int.from_bytes(data[offset + 8 : offset + 12], "little")
            value = (high << 32) | low
            raw = value.to_bytes(8, "big")
            return "-".join(f"{b:02x}" for b in raw)
        offset = (header >> 20) & 0xFFC
        seen += 1
    return None
