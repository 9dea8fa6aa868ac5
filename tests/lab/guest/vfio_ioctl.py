"""The VFIO ioctls a VMM makes, from stdlib Python (runs inside the lab guest).

Numbers from <linux/vfio.h>: every call is `_IO(';', 100 + n)`. A holder made here is a real VFIO user: the
kernel counts it (sysfs `enable`), refuses a second open (EBUSY) and blocks unbind until it lets go.
"""

from __future__ import annotations

import fcntl
import os
import struct
from dataclasses import dataclass

GET_API_VERSION = 0x3B64
CHECK_EXTENSION = 0x3B65
SET_IOMMU = 0x3B66
GROUP_GET_STATUS = 0x3B67
GROUP_SET_CONTAINER = 0x3B68
GROUP_GET_DEVICE_FD = 0x3B6A
DEVICE_GET_INFO = 0x3B6B
DEVICE_RESET = 0x3B6F
TYPE1V2_IOMMU = 3
GROUP_FLAGS_VIABLE = 1


@dataclass
class Opened:
    container: int
    group: int
    device: int

    def close_group_and_container(self) -> None:
        """What a VMM may do after setup: keep only the device fd (the group stays referenced by it)."""
        os.close(self.group)
        os.close(self.container)
        self.group = self.container = -1


def group_viable(group: int) -> bool:
    fd = os.open(f"/dev/vfio/{group}", os.O_RDWR)
    try:
        buf = bytearray(struct.pack("II", 8, 0))
        fcntl.ioctl(fd, GROUP_GET_STATUS, buf, True)
        return bool(struct.unpack("II", buf)[1] & GROUP_FLAGS_VIABLE)
    finally:
        os.close(fd)


def open_device(bdf: str, group: int) -> Opened:
    """Container + group + device fd, exactly a VMM's sequence (type1v2 IOMMU)."""
    container = os.open("/dev/vfio/vfio", os.O_RDWR | os.O_CLOEXEC)
    if fcntl.ioctl(container, GET_API_VERSION) != 0:
        raise OSError("unexpected VFIO API version")
    if not fcntl.ioctl(container, CHECK_EXTENSION, TYPE1V2_IOMMU):
        raise OSError("no type1v2 IOMMU")
    gfd = os.open(f"/dev/vfio/{group}", os.O_RDWR | os.O_CLOEXEC)
    fcntl.ioctl(gfd, GROUP_SET_CONTAINER, bytearray(struct.pack("i", container)), True)
    fcntl.ioctl(container, SET_IOMMU, TYPE1V2_IOMMU)
    dfd = fcntl.ioctl(gfd, GROUP_GET_DEVICE_FD, bytearray(bdf.encode() + b"\0"), True)
    info = bytearray(struct.pack("IIII", 16, 0, 0, 0))
    fcntl.ioctl(dfd, DEVICE_GET_INFO, info, True)
    return Opened(container, gfd, dfd)


def device_reset(dfd: int) -> None:
    fcntl.ioctl(dfd, DEVICE_RESET)
