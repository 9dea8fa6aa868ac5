"""SysfsPciHost reading a fake sysfs tree on disk, through the same symlinks the kernel makes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cubeaccel.host.pci.base import HostError
from cubeaccel.model.bars import Bar, BarKind
from cubeaccel.model.device import PciAddress
from tests.support.fake_sysfs import Dev, FakeSysfs

GPU = "0000:3b:00.0"
AUDIO = "0000:3b:00.1"
PORT = "0000:3a:00.0"


@pytest.fixture
def fake(tmp_path: Path) -> FakeSysfs:
    return FakeSysfs.build(
        tmp_path,
        [
            Dev(PORT, vendor=0x8086, device=0x352A, class_code=0x060400, driver="pcieport", native="pcieport",
                iommu_group=11, aer_fatal=None, reset_method=()),
            Dev(GPU, parent=PORT, iommu_group=12, numa_node=1, serial=0x0123456789ABCDEF, sriov_totalvfs=4),
            Dev(AUDIO, parent=PORT, device=0x22A3, class_code=0x040300, driver="snd_hda_intel",
                native="snd_hda_intel", iommu_group=12, reset_method=("pm",)),
        ],
    )  # fmt: skip


def test_links_are_shaped_like_the_kernel_makes_them(fake: FakeSysfs) -> None:
    link = fake.sys / "bus/pci/devices" / GPU
    assert os.readlink(link) == f"../../../devices/pci0000:3a/{PORT}/{GPU}"
    assert os.readlink(link / "driver") == "../../../../bus/pci/drivers/nvidia"
    assert os.readlink(link / "iommu_group") == "../../../../kernel/iommu_groups/12"
    assert (fake.sys / "kernel/iommu_groups/12/devices" / GPU / "vendor").read_text() == "0x10de\n"


def test_every_attribute_of_a_gpu_is_read(fake: FakeSysfs) -> None:
    f = fake.host().function(PciAddress.parse(GPU))
    assert f is not None
    assert (f.vendor_id, f.device_id, f.subsystem_vendor_id, f.subsystem_device_id) == (0x10DE, 0x2331, 0x10DE, 0x1839)
    assert (f.class_code, f.revision, f.numa_node, f.iommu_group) == (0x030200, 0xA1, 1, 12)
    assert (f.driver, f.driver_override) == ("nvidia", None)
    pref = BarKind.MEM64
    assert f.bars == (Bar(0, 16 << 20, pref, True), Bar(2, 128 << 30, pref, True), Bar(4, 32 << 20, pref, True))
    assert f.identity.bars == f.bars  # discovery hands them on with the identity
    assert (f.link_speed, f.link_width) == ("32.0 GT/s PCIe", "16")
    assert (f.sriov_totalvfs, f.sriov_numvfs) == (4, 0)
    assert f.reset_method == ("flr", "bus")
    assert (f.aer_fatal, f.aer_nonfatal) == (0, 0)
    assert f.serial == "01-23-45-67-89-ab-cd-ef"
    assert f.enabled


def test_functions_lists_every_function_in_bus_order(fake: FakeSysfs) -> None:
    host = fake.host()
    assert [str(f.address) for f in host.functions()] == [PORT, GPU, AUDIO]
    assert host.iommu_group_members(12) == [PciAddress.parse(GPU), PciAddress.parse(AUDIO)]
    assert host.iommu_group_members(99) == []
    port = host.function(PciAddress.parse(PORT))
    assert port is not None and port.is_bridge and port.aer_fatal is None and port.reset_method == ()


def test_config_space_vendor_is_read_from_config(fake: FakeSysfs) -> None:
    host = fake.host()
    assert host.config_vendor_id(PciAddress.parse(GPU)) == 0x10DE
    (fake.devdir(GPU) / "config").write_bytes(b"\xff" * 64)
    assert host.config_vendor_id(PciAddress.parse(GPU)) == 0xFFFF


def test_a_vanished_function_reads_as_none_not_an_error(fake: FakeSysfs) -> None:
    host = fake.host()
    fake.remove_device(AUDIO)
    assert host.function(PciAddress.parse(AUDIO)) is None
    assert host.config_vendor_id(PciAddress.parse(AUDIO)) == 0xFFFF
    assert [str(f.address) for f in host.functions()] == [PORT, GPU]


def test_entries_that_are_not_addresses_are_ignored(fake: FakeSysfs) -> None:
    devices = fake.sys / "bus/pci/devices"
    (devices / "..evil").mkdir()
    (devices / "0000:3B:00.0x").mkdir()
    (fake.sys / "kernel/iommu_groups/12/devices/not-a-bdf").mkdir()
    host = fake.host()
    assert [str(f.address) for f in host.functions()] == [PORT, GPU, AUDIO]
    assert len(host.iommu_group_members(12)) == 2


def test_a_driver_link_with_a_strange_name_counts_as_bound_but_never_becomes_a_path(fake: FakeSysfs) -> None:
    link = fake.devdir(AUDIO) / "driver"
    link.unlink()
    link.symlink_to("../../../../bus/pci/drivers/EVIL DRIVER\n")
    host = fake.host()
    f = host.function(PciAddress.parse(AUDIO))
    assert f is not None and f.driver == "EVIL DRIVER?"
    with pytest.raises(HostError) as e:
        host.bind(PciAddress.parse(AUDIO), "vfio-pci")
    assert e.value.code == "host.bind_failed"
    assert fake.writes == []


def test_driver_availability_and_iommu_groups(fake: FakeSysfs) -> None:
    host = fake.host()
    assert host.driver_available("vfio-pci")
    assert not host.driver_available("nouveau")
    assert host.iommu_groups_present()
