"""The guest end of a virtio-serial port, shared by the validation agent and the workload service (neither
imports the other: a workload must not be able to reach or impersonate validation code)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from cubeaccel.protocol.errors import CubeError

__all__ = ["open_port", "resolve_port"]


def resolve_port(name_or_path: str, root: Path = Path("/"), wait_s: float = 0.0) -> Path:
    """A path, or a virtio-serial port name found via /dev/virtio-ports or /sys/class/virtio-ports.

    Guests without udev have no /dev/virtio-ports symlinks, only /dev/vportNpM and the name in sysfs.
    """
    deadline = time.monotonic() + wait_s
    while True:
        found = _find_port(name_or_path, root)
        if found is not None:
            return found
        if time.monotonic() >= deadline:
            raise CubeError("guest.port_not_found", f"no such port: {name_or_path}", layer="agent", status=404)
        time.sleep(0.05)  # waiting for the kernel to create the device node; bounded by wait_s


def _find_port(name_or_path: str, root: Path) -> Path | None:
    if "/" in name_or_path:
        path = Path(name_or_path)
        return path if path.exists() else None
    link = root / "dev/virtio-ports" / name_or_path
    if link.exists():
        return link
    sysfs = root / "sys/class/virtio-ports"
    try:
        entries = sorted(os.listdir(sysfs))
    except OSError:
        return None
    for entry in entries:
        try:
            if (sysfs / entry / "name").read_text().strip() == name_or_path and (root / "dev" / entry).exists():
                return root / "dev" / entry
        except OSError:
            continue
    return None


def open_port(path: Path) -> int:
    """Non-blocking, so a host that stops reading makes write_all time out instead of hanging the agent."""
    return os.open(path, os.O_RDWR | os.O_NOCTTY | os.O_NONBLOCK)
