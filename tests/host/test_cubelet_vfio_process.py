"""`cubeaccel cubelet serve --backend vfio --sysfs-root FAKE` as a real process over a fake sysfs tree.

The fake tree's "kernel" lives in the test process, so writes the Cubelet process makes land in plain files:
we assert them, and the state the Cubelet draws from sysfs that did not change.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cubeaccel.wire.cubelet_api import Device
from tests.support.cubelet_process import CubeletProcess
from tests.support.fake_sysfs import Dev, FakeSysfs
from tests.support.holder_proc import unreadable_pids
from tests.support.poll import poll


def _fake(tmp_path: Path) -> FakeSysfs:
    return FakeSysfs.build(
        tmp_path / "fake",
        [
            Dev("0000:3b:00.0", iommu_group=1, driver="vfio-pci", numa_node=0),
            Dev("0000:86:00.0", iommu_group=2, driver="vfio-pci", numa_node=1),
            Dev("0000:af:00.0", iommu_group=3, driver="nvidia", numa_node=1),
            Dev(
                "0000:00:1f.3",
                vendor=0x8086,
                device=0x51C8,
                class_code=0x040300,
                iommu_group=4,
                driver="snd_hda_intel",
                native="snd_hda_intel",
            ),
        ],
    )


def _process(tmp_path: Path, fake: FakeSysfs, *extra: str) -> CubeletProcess:
    state = tmp_path / "state"
    state.mkdir()
    return CubeletProcess(
        state,
        "-",
        "--backend",
        "vfio",
        "--sysfs-root",
        str(fake.sys),
        "--allow",
        "10de:*",
        "--dev-root",
        str(fake.dev),
        "--proc-root",
        str(fake.proc),
        *(f"--holder-scan-exempt-pid={pid}" for pid in unreadable_pids()),
        *extra,
    )


@pytest.fixture
def vfio_node(tmp_path: Path) -> Iterator[tuple[CubeletProcess, FakeSysfs]]:
    fake = _fake(tmp_path)
    # These tests are about the sysfs code; whether this machine's image cache holds an NVIDIA scrub image that
    # carries this tree's agent (host readiness: cubelet/scrub_ready.py) is the next test's.
    p = _process(tmp_path, fake, "--scrub", "gpu=none").start()
    yield p, fake
    p.stop()


def test_without_the_gpu_scrub_image_the_gpus_are_held_and_the_host_reply_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUBEACCEL_CACHE_DIR", str(tmp_path / "empty-cache"))  # the Cubelet process inherits it
    p = _process(tmp_path, _fake(tmp_path)).start()
    try:
        devs = _by_address(p)
        assert {(d.state, d.reason) for d in devs.values()} == {("initialized", "host.scrub_image_missing")}
        host = p.client.host()
        assert host.ready is True and [x.code for x in host.problems] == ["host.scrub_image_missing"]
        assert "cubeaccel image build --vendor nvidia" in host.problems[0].message
    finally:
        p.stop()


def _by_address(p: CubeletProcess) -> dict[str, Device]:
    return {str(d.address): d for d in p.client.devices()}


def test_discovers_binds_and_validates_through_real_sysfs_code(vfio_node: tuple[CubeletProcess, FakeSysfs]) -> None:
    p, fake = vfio_node
    devs = _by_address(p)
    assert set(devs) == {"0000:3b:00.0", "0000:86:00.0", "0000:af:00.0"}  # the audio function is not ours
    assert devs["0000:3b:00.0"].state == "allocatable"
    assert devs["0000:3b:00.0"].labels["model"] == "H100-PCIe-80GB"
    # The nvidia-bound one was bound the documented way: override, unbind the old driver, probe; never new_id.
    sysfs = fake.sys
    assert (sysfs / "bus/pci/devices/0000:af:00.0/driver_override").read_text().strip() == "vfio-pci"
    assert (sysfs / "bus/pci/drivers/nvidia/unbind").read_text().strip() == "0000:af:00.0"
    assert (sysfs / "bus/pci/drivers_probe").read_text().strip() == "0000:af:00.0"
    assert (sysfs / "bus/pci/drivers/vfio-pci/new_id").read_text() == ""
    # No kernel applied the probe here, so the bind did not take: Cubelet checks, and never hands it out.
    assert devs["0000:af:00.0"].state == "unhealthy"
    assert devs["0000:af:00.0"].reason == "backend.bind_failed"


def test_release_resets_through_the_reset_attribute_and_revalidates(
    vfio_node: tuple[CubeletProcess, FakeSysfs],
) -> None:
    p, fake = vfio_node
    body = p.client.reserve("sb", 1, labels={"numa_node": "1"})
    dev = body.devices[0]
    assert dev.address == "0000:86:00.0"
    p.client.release("sb")
    poll(lambda: _by_address(p)["0000:86:00.0"].state == "allocatable")
    assert (fake.sys / "bus/pci/devices/0000:86:00.0/reset").read_text().strip() == "1"
    assert (fake.sys / "bus/pci/devices/0000:3b:00.0/reset").read_text() == ""  # untouched


def test_identity_change_at_the_same_address_is_caught_by_periodic_reconcile(
    vfio_node: tuple[CubeletProcess, FakeSysfs],
) -> None:
    p, fake = vfio_node
    fake.change_identity("0000:3b:00.0", 0x2330)
    poll(lambda: _by_address(p)["0000:3b:00.0"].state == "unhealthy")
    assert _by_address(p)["0000:3b:00.0"].reason == "host.identity_changed"
