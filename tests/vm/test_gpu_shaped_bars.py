"""A GPU-sized BAR in a real MicroVM: the machine is shaped for it, and attach is confirmed only once the guest
placed it (`pci-testdev,membar=64G`, a 64 GiB 64-bit prefetchable BAR2 with no RAM behind it)."""

from __future__ import annotations

from typing import Any

import pytest
from qemu.qmp.legacy import QEMUMonitorProtocol

from cubeaccel.backends.emulated import pci_testdev_identity
from cubeaccel.host.service.unix_path import connect_path
from cubeaccel.model.bars import Bar, BarKind
from tests.vm.conftest import ShimRun, emulated_id

pytestmark = pytest.mark.vm

GIB = 1 << 30
MEMBAR = 64 * GIB


def _testdev(record_bars: tuple[Bar, ...]) -> dict[str, Any]:
    """The stand-in as Cubelet hands it to the shim: QEMU gets membar=64G; `record_bars` is what discovery said."""
    return {
        "device_id": emulated_id(0),
        "driver": "pci-testdev",
        "properties": {"membar": str(MEMBAR)},
        "vendor_id": "1b36",
        "device_id_hex": "0005",
        "bars": [b.to_json() for b in record_bars],
    }


def _device_bar2(run: ShimRun) -> dict[str, Any]:
    """BAR2 of the function behind root port rp1 as QEMU describes it (its address reads -1 until a guest driver
    enables memory decoding, which nothing does for pci-testdev: where the guest placed it is its `resource`)."""
    aux = QEMUMonitorProtocol(connect_path(run.state_dir / "qmp-aux.sock"))
    aux.connect()
    try:
        buses: Any = aux.cmd("query-pci")  # QMP's JSON
    finally:
        aux.close()
    port = next(d for d in buses[0]["devices"] if d.get("qdev_id") == "rp1")
    (dev,) = port["pci_bridge"]["devices"]
    return dict(next(r for r in dev["regions"] if r["bar"] == 2))


def test_a_64_gib_bar_is_placed_by_the_guest_in_a_machine_shaped_for_it(shim_factory: Any) -> None:
    run = shim_factory(start="cold", device=_testdev(pci_testdev_identity(MEMBAR).bars)).start()
    attached = run.wait_for("device_attached", timeout_s=120)
    placed = {b["bar"]: b for b in attached["details"]["guest_bars"]}
    assert placed["BAR2"]["size"] == MEMBAR  # the guest's own resource file
    assert int(placed["BAR2"]["start"], 16) % MEMBAR == 0
    bar2 = _device_bar2(run)  # the device really has a 64 GiB 64-bit prefetchable BAR2
    assert bar2["size"] == MEMBAR and bar2["prefetch"] and bar2["mem_type_64"]
    assert run.terminate() == 0


def test_the_same_device_in_a_machine_shaped_for_2_gib_fails_at_backend_naming_the_bar(shim_factory: Any) -> None:
    """Discovery recorded a 1 GiB BAR2 (a stale record), so the machine keeps today's 2 GiB windows; the 64 GiB BAR
    the VMM then exposes has no room, and the start fails instead of reporting an unusable device attached."""
    stale = (Bar(0, 4096, BarKind.MEM32), Bar(1, 256, BarKind.IO), Bar(2, GIB, BarKind.MEM64, prefetch=True))
    run = shim_factory(start="cold", device=_testdev(stale)).start()
    failed = run.wait_for("attach_failed", timeout_s=120)
    details = failed["details"]
    assert (details["reason"], details["layer"], details["bar"]) == ("attach.bar_unassigned", "backend", "BAR2")
    assert "BAR2" in details["message"] and details["root_port"]["pref64_bytes"] == 2 * GIB
    assert "device_attached" not in run.kinds()
    run.wait_for("vmm_exited", timeout_s=60)
