"""Cubelet --backend vfio starts a real shim whose real QEMU refuses `vfio-pci` (no IOMMU here):
the attach failure goes through the release rules and the device comes back only after the VMM is gone."""

from __future__ import annotations

from pathlib import Path

import pytest

from cubeaccel.images.manifest import Manifest
from cubeaccel.wire.cubelet_api import Event
from tests.support.cubelet_process import CubeletProcess
from tests.support.fake_sysfs import Dev, FakeSysfs
from tests.support.holder_proc import unreadable_pids
from tests.support.poll import poll
from tests.support.vmm_cleanup import kill_started_vmms

pytestmark = pytest.mark.vm


def test_vfio_hotplug_refused_by_qemu_is_attach_failed_and_released_safely(
    tmp_path: Path, guest_image: Manifest
) -> None:
    fake = FakeSysfs.build(tmp_path / "fake", [Dev("0000:3b:00.0", iommu_group=1, driver="vfio-pci")])
    state = tmp_path / "state"
    state.mkdir()
    p = CubeletProcess(
        state,
        "-",
        "--backend",
        "vfio",
        "--sysfs-root",
        str(fake.sys),
        "--dev-root",
        str(fake.dev),
        "--proc-root",
        str(fake.proc),
        *(f"--holder-scan-exempt-pid={pid}" for pid in unreadable_pids()),
        # no scrub VM: this is about the refused hot-plug's release (a fake sysfs device cannot be scrubbed)
        "--scrub",
        "gpu=none",
        "--scrub",
        "accelerator=none",
    ).start()
    try:
        body = p.client.reserve("vf-1", 1, memory_mib=256, start=True)
        dev = body.devices[0].id

        def events() -> list[Event]:
            return p.client.events(0, 10000).events

        poll(lambda: any(e.event == "attach_failed" and e.kind == "shim_report" for e in events()), 120)
        poll(lambda: p.client.devices()[0].state == "allocatable", 60)
        failed = next(e for e in events() if e.event == "attach_failed" and e.kind == "shim_report")
        assert "vfio" in str(failed.details).lower()
        trail = [e.event for e in events() if e.device_id == dev and e.kind == "transition"]
        assert trail[-3:] == ["attach_failed", "release_confirmed", "revalidated"]
        assert "attach_succeeded" not in trail
        assert p.vmm("vf-1") is None
        assert (fake.sys / "bus/pci/devices/0000:3b:00.0/reset").read_text().strip() == "1"
    finally:
        p.stop()
        kill_started_vmms(state)
