"""Scrub between tenants with real MicroVMs: Cubelet with the emulated backend, two tenants in sequence on one
device, and the trusted scrub VM (the same shim in scrub mode, our own guest image, no workload channel) between.

What the emulated device can and cannot show (docs/scrub.md): QEMU's edu lives inside its VMM, so its registers die
with tenant A's VMM — tenant B reading zero would hold without any scrub. What this proves is the flow on real
parts: the marker location is tenant-writable through BAR0 (tenant A writes and reads it back as root, through the
workload channel), the scrub VM boots with the device, its agent writes and verifies those registers through BAR0,
the device is `released` (not allocatable) until the scrub passed and the device was reset again, the events carry
the timing, tenant B sees zeros there, and a scrub that does not finish quarantines the device.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from cubeaccel.images.manifest import Manifest
from cubeaccel.model.reservation_states import ReservationPhase
from cubeaccel.protocol.errors import CubeError
from cubeaccel.wire.cubelet_api import Device, Event
from tests.support.cubelet_process import CubeletProcess
from tests.support.poll import poll
from tests.support.vmm_cleanup import kill_started_vmms
from tests.workload_client import WorkloadClient

pytestmark = pytest.mark.vm
MARKER = {"dma_src": 0x5EC2E7A11CE, "dma_dst": 0xB0B, "dma_count": 0x1234}

# Runs in the tenant's guest as root: find the edu, write (optional) and read its registers through resource0.
BAR_SCRIPT = """
import glob, json, os, sys
from cubeaccel.agent.scrub import EDU_REGISTERS, read_bar, write_bar
from pathlib import Path
dev = next(Path(p).parent for p in glob.glob("/sys/bus/pci/devices/*/vendor")
           if open(p).read().strip() == "0x1234" and open(Path(p).parent / "device").read().strip() == "0x11e8")
values = json.loads(sys.argv[1])
if values:
    write_bar(dev, values, EDU_REGISTERS)
print(json.dumps(read_bar(dev, EDU_REGISTERS)))
"""


def _events(p: CubeletProcess) -> list[Event]:
    return p.client.events(0, 10000).events


def _state(p: CubeletProcess, dev: str) -> Device:
    return next(d for d in p.client.devices() if d.id == dev)


def _tenant(p: CubeletProcess, sid: str, dev: str | None = None) -> tuple[str, WorkloadClient]:
    body = p.client.reserve(sid, 1, start=True, memory_mib=256)
    got = body.devices[0].id
    assert dev is None or got == dev, (got, dev)
    poll(lambda: _phase(p, sid) is ReservationPhase.RUNNING, 120)
    http = httpx.Client(
        transport=httpx.HTTPTransport(uds=str(p.state_dir / "cubelet.sock")),
        base_url=f"http://cubelet/v1/sandboxes/{sid}/workload",
        timeout=60,
    )
    assert body.access_token is not None
    return got, WorkloadClient(http, body.access_token)


def _phase(p: CubeletProcess, sid: str) -> ReservationPhase | None:
    res = p.client.reservation(sid).reservation
    return None if res is None else res.phase


def _bar(wl: WorkloadClient, values: dict[str, int]) -> dict[str, int]:
    s = wl.run(f"PYTHONPATH=/opt/cubeaccel python3 -c '{BAR_SCRIPT}' '{json.dumps(values)}'", user="root")
    assert s.end.get("exitCode", 0) == 0, (s.end, s.output("stderr"))
    return dict(json.loads(s.output().decode().strip().splitlines()[-1]))


@pytest.fixture
def cubelet(tmp_path: Path, guest_image: Manifest, request: pytest.FixtureRequest) -> Any:
    extra = getattr(request, "param", ())
    p = CubeletProcess(tmp_path, "-", "--backend", "emulated", "--release-timeout", "20", *extra)
    p.start()
    yield p
    p.stop()
    kill_started_vmms(tmp_path)  # this Cubelet's VMMs only (tenants' and scrub VMs'), by their pid files


def test_two_tenants_in_sequence_with_the_scrub_vm_between(cubelet: CubeletProcess) -> None:
    dev, a = _tenant(cubelet, "tenant-a")
    assert _bar(a, MARKER) == {"liveness": 0, **MARKER}  # tenant-writable, read back through BAR0
    cubelet.client.release("tenant-a")
    poll(lambda: any(e.kind == "scrub_started" for e in _events(cubelet)), 60)
    # Until the scrub VM passed, the device is not the next tenant's: a second reservation finds nothing.
    assert _state(cubelet, dev).state in ("released", "allocatable")
    if _state(cubelet, dev).state == "released":
        assert _state(cubelet, dev).reason == "release.scrub_pending"
        with pytest.raises(CubeError) as refused:  # 2 slots, 1 free
            cubelet.client.reserve("too-early", 2)
        assert refused.value.code == "reserve.insufficient_devices"
    poll(lambda: _state(cubelet, dev).state == "allocatable", 180)
    events = [e for e in _events(cubelet) if e.device_id == dev]
    kinds = [e.event or e.kind for e in events]
    order = [kinds.index(k) for k in ("release_confirmed", "scrub_started", "scrub_finished", "revalidated")]
    assert order == sorted(order), kinds
    done = next(e for e in events if e.kind == "scrub_finished").details
    assert done["ok"] is True and done["method"] == "bar"
    assert done["bytes_zeroed"] == done["bytes_verified"] == 28  # liveness (4) + three 64-bit DMA registers
    assert done["agent"]["mismatches"] == [] and done["duration_s"] > 0
    assert done["timeline"]["scrub_s"] >= 0 and "vmm_exit_s" in done["timeline"]
    scrub_vm = done["scrub_vm"]
    assert scrub_vm.startswith("scrub-") and cubelet.vmm(scrub_vm) is None  # the scrub VM is gone
    assert _state(cubelet, dev).reason is None
    _, b = _tenant(cubelet, "tenant-b", dev)
    assert _bar(b, {}) == {"liveness": 0, "dma_src": 0, "dma_dst": 0, "dma_count": 0}
    cubelet.client.release("tenant-b")  # its own scrub follows; the fixture stops it with the Cubelet


@pytest.mark.parametrize("cubelet", [("--scrub-timeout", "0.5")], indirect=True)
def test_a_scrub_vm_that_does_not_finish_quarantines_the_device(cubelet: CubeletProcess) -> None:
    body = cubelet.client.reserve("tenant-a", 1, start=True, memory_mib=256)
    dev = body.devices[0].id
    poll(lambda: _state(cubelet, dev).state == "attached", 120)
    cubelet.client.release("tenant-a")
    poll(lambda: _state(cubelet, dev).state == "quarantined", 90)
    assert _state(cubelet, dev).reason == "release.scrub_failed"
    done = next(e for e in _events(cubelet) if e.kind == "scrub_finished" and e.device_id == dev)
    assert done.details["ok"] is False and "did not finish within 0.5s" in done.details["message"]
    assert cubelet.vmm(done.details["scrub_vm"]) is None  # stopped at the deadline, not left running
    assert not any(e.event == "revalidated" for e in _events(cubelet) if e.device_id == dev)
