"""`wait_pci`: block in the guest until a hot-plugged PCI function appears, instead of the host polling probes.

The host used to send a full probe every 20 ms after `device_add` (and one before it, to know what was already
there). Now it sends one request; the guest listens for the kernel's uevents (netlink) and looks at
/sys/bus/pci/devices on each one — and every 50 ms regardless, so a missed or unavailable uevent socket only
costs latency. Only addresses not in `known` are read, so each look costs a directory listing.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import time

from cubeaccel.agent.probes import ProbeContext
from cubeaccel.protocol.agent_messages import PciFunction, WaitPciResult

RECHECK_S = 0.05
NETLINK_KOBJECT_UEVENT = 15


def _read_id(path: str) -> str:
    try:
        with open(path) as f:
            raw = f.read().strip().lower()
    except OSError:
        return ""
    return raw[2:] if raw.startswith("0x") else raw


def find_new(ctx: ProbeContext, vendor: str, device: str, known: frozenset[str]) -> PciFunction | None:
    """The first function (by address) not in `known` with this vendor:device, or None."""
    base = ctx.path("/sys/bus/pci/devices")
    try:
        names = sorted(n for n in os.listdir(base) if n not in known)
    except OSError:
        return None
    for name in names:
        found = {
            key: _read_id(str(base / name / file)) for key, file in (("vendor_id", "vendor"), ("device_id", "device"))
        }
        if found == {"vendor_id": vendor, "device_id": device}:
            return PciFunction(name, vendor, device, _read_id(str(base / name / "class")))
    return None


MAX_RESOURCE_BYTES = 4096  # 6 BARs, the ROM and 6 bridge windows are 13 lines of 57 bytes


def read_resource(ctx: ProbeContext, address: str) -> str | None:
    """/sys/bus/pci/devices/ADDRESS/resource (None when the function or the file is not there)."""
    try:
        with open(ctx.path("/sys/bus/pci/devices") / address / "resource", errors="replace") as f:
            return f.read(MAX_RESOURCE_BYTES)
    except OSError:
        return None


def _uevents(ctx: ProbeContext) -> socket.socket | None:
    """The kernel's uevent broadcast, only for the real guest root (tests lay out a fake sysfs elsewhere)."""
    if str(ctx.root) != "/" or not hasattr(socket, "AF_NETLINK"):
        return None
    try:
        s = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_KOBJECT_UEVENT)
    except OSError:
        return None
    try:
        s.bind((0, 1))
        s.setblocking(False)
    except OSError:
        s.close()
        return None
    return s


def wait_pci(ctx: ProbeContext, vendor: str, device: str, known: frozenset[str], timeout_s: float) -> WaitPciResult:
    """The function (or None), how long it took, and whether the netlink socket was there at all. Listening
    starts before the first look, so an add that lands between the two is still seen."""
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    events = _uevents(ctx)
    try:
        while (found := find_new(ctx, vendor, device, known)) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if events is None:
                time.sleep(min(left, RECHECK_S))
                continue
            if select.select([events], [], [], min(left, RECHECK_S))[0]:
                with contextlib.suppress(BlockingIOError, OSError):
                    while events.recv(65536):
                        pass
    finally:
        if events is not None:
            events.close()
    return WaitPciResult(found, round((time.monotonic() - t0) * 1000, 1), events is not None)
