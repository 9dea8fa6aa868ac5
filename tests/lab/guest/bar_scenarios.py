"""A GPU-sized BAR through the real kernel's VFIO: QEMU's pci-testdev with a 64 GiB 64-bit prefetchable BAR2
(no RAM behind it), bound to vfio-pci in the lab guest and hot-plugged into the lab's own QEMU.

The lab's QEMU boots only its firmware (no kernel; `reboot-timeout=-1` keeps SeaBIOS from restarting the machine)
so its root port's bus is numbered and `query-pci` lists what is plugged behind it: the BAR sizes QEMU read from
VFIO's region info for the device it holds.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path
from typing import Any

from scenarios import backend, ensure_vfio, fn, holders, ms_since, problems, record
from vmm_scenarios import ENV, GUEST_MIB, QEMU_HOME, Qmp, Vmm, _release

from cubeaccel.model.device import PciAddress

TESTDEV_IDS = ("0x1b36", "0x0005")
SYS = Path("/sys/bus/pci/devices")
BAR = 2


def find_testdev() -> PciAddress:
    for d in sorted(SYS.iterdir()):
        ids = ((d / "vendor").read_text().strip(), (d / "device").read_text().strip())
        if ids == TESTDEV_IDS:
            return PciAddress.parse(d.name)
    raise AssertionError("no pci-testdev in the lab guest")


def resource(address: PciAddress, index: int) -> dict[str, int]:
    """Line `index` of sysfs `resource`: how this (L1) kernel placed the BAR."""
    start, end, flags = (int(x, 16) for x in (SYS / str(address) / "resource").read_text().splitlines()[index].split())
    return {"start": start, "size": end - start + 1 if end else 0, "flags": flags}


def start_firmware_only(name: str, qmp_dir: str = "/tmp") -> Vmm:
    sock = f"{qmp_dir}/{name}.qmp"
    args = [
        f"{QEMU_HOME}/bin/qemu-system-x86_64", "-L", f"{QEMU_HOME}/share",
        "-name", f"guest=cubeaccel-sandbox={name}", "-nodefaults", "-no-user-config", "-display", "none",
        "-machine", "q35", "-accel", "tcg,tb-size=16", "-m", str(GUEST_MIB), "-boot", "reboot-timeout=-1",
        "-device", "pcie-root-port,id=rp1,chassis=1,slot=1",
        "-qmp", f"unix:{sock},server=on,wait=off",
    ]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.Popen(args, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        client = Qmp(sock, 30.0)
    except OSError:
        proc.kill()
        _out, err = proc.communicate()
        raise OSError(f"QEMU did not come up: {err.decode(errors='replace')[-800:]}") from None
    return Vmm(proc, client, time.monotonic() - t0)


def _root_port(qmp: Qmp) -> dict[str, Any]:
    devices = qmp.cmd("query-pci")["return"][0]["devices"]
    return next(d for d in devices if d.get("qdev_id") == "rp1")


def vfio_large_bar() -> dict[str, Any]:
    address = find_testdev()
    out: dict[str, Any] = {"address": str(address), "l1_resource": resource(address, BAR)}
    ensure_vfio(address)
    out["driver"] = fn(address).driver
    out["validate_before"] = problems(backend.validate(record(address)))
    vmm = start_firmware_only("lab-large-bar")
    try:
        assert vmm.qmp is not None
        t0 = time.monotonic()
        deadline = t0 + 90
        while (bus := _root_port(vmm.qmp)["pci_bridge"]["bus"])["secondary"] == 0:
            assert time.monotonic() < deadline, "the lab QEMU's firmware never numbered its root port's bus"
            time.sleep(0.2)
        out["firmware_ms"] = ms_since(t0)
        out["root_port_bus"] = bus
        t1 = time.monotonic()
        out["device_add"] = vmm.qmp.cmd("device_add", driver="vfio-pci", host=str(address), bus="rp1", id="big0")
        out["device_add_ms"] = ms_since(t1)
        out["holders"] = holders(address)
        out["vmm_pid"] = vmm.pid
        behind = _root_port(vmm.qmp)["pci_bridge"].get("devices", [])
        out["query_pci"] = [d for d in behind if d.get("qdev_id") == "big0"]
    except BaseException:
        with contextlib.suppress(Exception):
            vmm.quit()
        raise
    out["release"] = _release(address, vmm)
    return out


SCENARIOS = {f.__name__: f for f in (vfio_large_bar,)}
