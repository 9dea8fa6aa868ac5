"""Eight devices in one sandbox, through CubeMaster and a real MicroVM; more than the node's VM takes is refused
by CubeMaster with the node's reason before any Cubelet reserves anything.

The node: an emulated Cubelet with 17 edu stand-ins, one more than a sandbox's machine has hot-plug slots
(wire/shim_spec.py MAX_DEVICES = 16 root ports), so the refusal below is the per-sandbox limit, not a lack of
free devices.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cubeaccel.images.manifest import Manifest
from cubeaccel.protocol.errors import CubeError
from cubeaccel.wire.shim_spec import MAX_DEVICES
from tests.support.cubelet_process import CubeletProcess
from tests.support.master_harness import MasterProcess, emulated_cubelet
from tests.support.poll import poll
from tests.support.vmm_cleanup import kill_started_vmms
from tests.vm.test_master_ready import edu_template

pytestmark = pytest.mark.vm
NODE_DEVICES = MAX_DEVICES + 1


@pytest.fixture
def stack(tmp_path: Path, guest_image: Manifest) -> Iterator[tuple[MasterProcess, CubeletProcess]]:
    master = MasterProcess(tmp_path / "master").start()
    (tmp_path / "cubelet").mkdir()
    # No scrub VM per device at release (tested in test_scrub_between_tenants.py): eight of them in a row would
    # make this test about scrub throughput.
    cubelet = emulated_cubelet(
        master, tmp_path / "cubelet", "wide", "--emulated-devices", str(NODE_DEVICES), "--scrub", "accelerator=none"
    )
    cubelet.start()
    try:
        poll(lambda: any(n.node == "wide" and n.state == "ready" for n in master.client.nodes()), 30)
        yield master, cubelet
    finally:
        cubelet.stop()
        master.stop()
        kill_started_vmms(tmp_path)  # this Cubelet's VMMs only, by their pid files


def _accelerators(count: int) -> dict[str, Any]:
    return {"template": "edu-wide", "accelerators": [{"class": "accelerator", "count": count}]}


def _allocatable(cubelet: CubeletProcess) -> int:
    return sum(d.state == "allocatable" for d in cubelet.client.devices())


def test_one_sandbox_holds_eight_devices_and_more_than_the_vm_takes_is_refused_before_any_reservation(
    stack: tuple[MasterProcess, CubeletProcess], guest_image: Manifest
) -> None:
    master, cubelet = stack
    master.client.register_template(edu_template(guest_image, "edu-wide"))
    node = next(n for n in master.client.nodes() if n.node == "wide")
    assert node.max_devices_per_sandbox == MAX_DEVICES and node.allocatable == NODE_DEVICES

    events_before = cubelet.client.events(0, 10000).events
    with pytest.raises(CubeError) as err:
        master.client.create(_accelerators(NODE_DEVICES))
    assert (err.value.code, err.value.status) == ("schedule.too_many_devices", 409)
    why = err.value.details["tried"][0]["nodes"]["wide"]
    assert why["reason"] == "device_limit" and f"at most {MAX_DEVICES}" in why["detail"]
    assert "attempts" not in err.value.details  # no Cubelet was asked
    after = cubelet.client.events(0, 10000).events
    assert not [e for e in after[len(events_before) :] if e.sandbox_id]  # no reservation, not even refused
    assert _allocatable(cubelet) == NODE_DEVICES

    sb = master.client.create(_accelerators(8))
    sid = sb.id
    poll(lambda: master.client.sandbox(sid).state == "running", 240)
    events = [e for e in cubelet.client.events(0, 10000).events if e.sandbox_id == sid]
    reports = [e for e in events if e.kind == "shim_report"]
    attached = [e.details for e in reports if e.event == "device_attached"]
    assert len(attached) == 8
    assert len({a["guest_address"] for a in attached}) == 8  # eight functions the guest saw appear
    assert sorted(a["bus"] for a in attached) == sorted(f"rp{i}" for i in range(1, 9))
    validated = next(e for e in reports if e.event == "guest_validated")
    in_guest = [d for d in validated.details["report"]["pci_devices"] if d.get("device_id") == "11e8"]
    assert len(in_guest) == 8
    held = [d for d in cubelet.client.devices() if d.sandbox_id == sid]
    assert len(held) == 8 and {d.state for d in held} == {"attached"}

    master.client.delete(sid)
    poll(lambda: _allocatable(cubelet) == NODE_DEVICES, 120)
