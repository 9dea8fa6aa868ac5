"""The names in a newc cpio archive (an image's rootfs.cpio), read without unpacking it."""

from __future__ import annotations

from pathlib import Path

_MAGIC = (b"070701", b"070702")


def cpio_names(path: Path) -> dict[str, int]:
    """Each member's name (no leading slash) and mode, up to the trailer."""
    data = path.read_bytes()
    out: dict[str, int] = {}
    i = 0
    while i + 110 <= len(data) and data[i : i + 6] in _MAGIC:
        mode, size, name_size = (
            int(data[i + 14 : i + 22], 16),
            int(data[i + 54 : i + 62], 16),
            int(data[i + 94 : i + 102], 16),
        )
        name = data[i + 110 : i + 110 + name_size - 1].decode(errors="replace")
        i += (110 + name_size + 3) & ~3
        i += (size + 3) & ~3
        if name == "TRAILER!!!":
            break
        out[name.lstrip("/")] = mode
    return out
