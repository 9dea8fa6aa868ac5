"""Read-only discovery of THIS machine's real /sys, checked against independent sources.

The host is opened `read_only=True`, so this test cannot write sysfs. Expected values come from
other kernel interfaces than the ones the code reads: each device's `uevent` (PCI_ID, PCI_SUBSYS_ID,
PCI_CLASS, DRIVER), the raw config space header, and `lspci -n` where it is installed.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from cubeaccel.backends.vfio import VfioBackend
from cubeaccel.host.pci.sysfs import SysfsPciHost

DEVICES = Path("/sys/bus/pci/devices")
pytestmark = pytest.mark.skipif(not DEVICES.is_dir() or not any(DEVICES.iterdir()), reason="no PCI bus in /sys")


def _uevent(bdf: str) -> dict[str, str]:
    lines = (DEVICES / bdf / "uevent").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line)


def test_every_real_function_matches_its_uevent_and_config_header() -> None:
    host = SysfsPciHost("/sys", read_only=True)
    functions = host.functions()
    assert sorted(str(f.address) for f in functions) == sorted(p.name for p in DEVICES.iterdir())
    for f in functions:
        ev = _uevent(str(f.address))
        vendor, device = (int(x, 16) for x in ev["PCI_ID"].split(":"))
        sub_vendor, sub_device = (int(x, 16) for x in ev["PCI_SUBSYS_ID"].split(":"))
        assert (f.vendor_id, f.device_id) == (vendor, device)
        assert (f.subsystem_vendor_id, f.subsystem_device_id) == (sub_vendor, sub_device)
        assert f.class_code == int(ev["PCI_CLASS"], 16)
        assert f.driver == ev.get("DRIVER")
        header = (DEVICES / str(f.address) / "config").read_bytes()[:12]
        assert int.from_bytes(header[0:2], "little") == f.vendor_id == host.config_vendor_id(f.address)
        assert header[8] == f.revision
        assert int.from_bytes(header[9:12], "little") == f.class_code


def test_virtio_functions_here_come_back_with_virtio_pci() -> None:
    virtio = [f for f in SysfsPciHost("/sys", read_only=True).functions() if f.vendor_id == 0x1AF4]
    if not virtio:
        pytest.skip("no virtio functions on this machine")
    for f in virtio:
        assert 0x1040 <= f.device_id <= 0x107F or 0x1000 <= f.device_id <= 0x103F  # modern / transitional ids
        assert f.driver == "virtio-pci"
        assert f.bars and all(b.size > 0 for b in f.bars)


@pytest.mark.skipif(shutil.which("lspci") is None, reason="lspci is not installed here")
def test_matches_lspci_numeric_listing() -> None:
    out = subprocess.run(["lspci", "-Dnk"], capture_output=True, text=True, check=True).stdout
    expected: dict[str, list[str | None]] = {}
    current = ""
    for line in out.splitlines():
        if not line.startswith("\t"):
            words = line.split()
            current = words[0]
            rev = words[4].rstrip(")") if len(words) > 4 and words[3] == "(rev" else "00"
            expected[current] = [words[2], words[1].rstrip(":"), rev, None]
        elif line.strip().startswith("Kernel driver in use:"):
            expected[current][3] = line.split(":", 1)[1].strip()
    got = {
        str(f.address): [f.identity.vendor_device, f"{f.class_code >> 8:04x}", f"{f.revision:02x}", f.driver]
        for f in SysfsPciHost("/sys", read_only=True).functions()
    }
    assert got == expected


def test_real_discovery_and_holders_run_on_a_read_only_host() -> None:
    """Only reads here: the read-only guard itself is exercised on the fake tree, never on real devices."""
    host = SysfsPciHost("/sys", read_only=True)
    backend = VfioBackend(host, allow=["*:*"])
    for f in host.functions():
        assert isinstance(host.holders(f.address), list)
    assert {str(d.address) for d in backend.discover()} <= {str(f.address) for f in host.functions()}
