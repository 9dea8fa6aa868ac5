"""Faults through Cubelet with real shims and real QEMU: cold start, a paused guest that never completes the
unplug, an injected holder that keeps the device open, and an NVIDIA contract in a guest without NVIDIA."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cubeaccel.host.service.unix_path import connect_path
from cubeaccel.host.vmm.vmmproc import ENV_DEVICES
from cubeaccel.images.manifest import Manifest
from cubeaccel.wire.cubelet_api import Device, Event
from tests.support.cubelet_process import CubeletProcess
from tests.support.poll import poll
from tests.support.vmm_cleanup import kill_started_vmms

pytestmark = pytest.mark.vm


def _dev(p: CubeletProcess, dev: str) -> Device:
    return next(d for d in p.client.devices() if d.id == dev)


def _events(p: CubeletProcess, sid: str) -> list[Event]:
    return [e for e in p.client.events(0, 10000).events if e.sandbox_id == sid]


# These faults are about the release rules before the scrub step: no scrub VM (one boot fewer per test; the scrub
# step's own faults are in test_scrub_between_tenants.py).
NO_SCRUB = ("--scrub", "accelerator=none")


@pytest.fixture
def node(tmp_path: Path, guest_image: Manifest, request: pytest.FixtureRequest) -> Iterator[CubeletProcess]:
    extra = getattr(request, "param", ())
    p = CubeletProcess(
        tmp_path, "-", "--backend", "emulated", "--detach-timeout", "1.5", "--release-timeout", "3", *NO_SCRUB, *extra
    ).start()
    yield p
    p.stop()
    kill_started_vmms(tmp_path)  # this Cubelet's VMMs only, by their pid files


@pytest.mark.parametrize("node", [("--vm-start", "cold")], indirect=True)
def test_cold_boot_through_cubelet_full_cycle(node: CubeletProcess) -> None:
    dev = node.client.reserve("f-cold", 1, memory_mib=256, start=True).devices[0].id
    poll(lambda: _dev(node, dev).state == "attached", 120)
    shim_kinds = [e.event for e in _events(node, "f-cold") if e.kind == "shim_report"]
    assert shim_kinds[:5] == ["vm_started", "vmm_confined", "memory_pinned", "guest_ready", "device_attached"]
    node.client.release("f-cold")
    poll(lambda: any(e.kind == "reservation_closed" for e in _events(node, "f-cold")), 60)
    assert _dev(node, dev).state == "allocatable"
    timeline = next(e for e in _events(node, "f-cold") if e.event == "shim_exiting").details["timeline"]
    assert "boot_to_agent_s" in timeline  # a cold boot, not a restore


@pytest.mark.parametrize("node", [("--release-timeout", "30")], indirect=True)  # let the shim time out first
def test_paused_guest_detach_times_out_and_device_returns_only_after_the_vmm_is_gone(node: CubeletProcess) -> None:
    from qemu.qmp.legacy import QEMUMonitorProtocol

    dev = node.client.reserve("f-paused", 1, memory_mib=256, start=True).devices[0].id
    poll(lambda: any(e.event == "guest_validated" for e in _events(node, "f-paused")), 120)  # running
    aux = QEMUMonitorProtocol(connect_path(node.state_dir / "shims" / "f-paused" / "qmp-aux.sock"))
    aux.connect()
    aux.cmd("stop")  # the guest can no longer answer the ACPI unplug request
    aux.close()
    node.client.release("f-paused")
    poll(lambda: any(e.event == "detach_timeout" for e in _events(node, "f-paused")), 60)
    poll(lambda: _dev(node, dev).state == "allocatable", 60)
    assert node.vmm("f-paused") is None
    confirmed = [e for e in _events(node, "f-paused") if e.event == "release_confirmed"]
    assert confirmed[-1].details["detach_confirmed"] is False and confirmed[-1].details["vmm_exited"] is True


def test_a_holder_that_keeps_the_device_open_ends_in_quarantine(node: CubeletProcess) -> None:
    dev = node.client.reserve("f-held", 1, memory_mib=256, start=True).devices[0].id
    poll(lambda: _dev(node, dev).state == "attached", 120)
    # An injected holder: a real process the backend's holder check sees holding this device — with the
    # evidence a VMM of this Cubelet carries (its files under the shims dir, this uid), else it is no holder.
    files = f"{node.state_dir.absolute()}/shims/intruder/vmm.log"
    intruder = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)", "-name", "guest=cubeaccel-sandbox=intruder", files],
        env={**os.environ, ENV_DEVICES: dev},
    )
    try:
        node.client.release("f-held")
        poll(lambda: _dev(node, dev).state == "quarantined", 60)
        assert _dev(node, dev).reason == "release.holder_stuck"
        poll(lambda: any(e.kind == "reservation_closed" for e in _events(node, "f-held")), 60)
    finally:
        intruder.kill()
        intruder.wait()
    # the tenant's leftovers are not proven gone: recover sends it through the scrub before it is allocatable
    assert node.client.verb(dev, "recover", "alice", "intruder gone").state in ("released", "allocatable")
    poll(lambda: _dev(node, dev).state == "allocatable", 120, what="scrubbed and revalidated after recover")
