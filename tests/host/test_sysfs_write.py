"""The writes SysfsPciHost makes, asserted as the exact sequence the fake kernel received."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from cubeaccel.host.pci.base import HostError
from cubeaccel.host.pci.sysfs import SysfsPciHost
from cubeaccel.model.device import PciAddress
from cubeaccel.protocol.errors import CubeError
from tests.support.fake_sysfs import Dev, FakeSysfs

GPU = "0000:3b:00.0"
ADDR = PciAddress.parse(GPU)


@pytest.fixture
def fake(tmp_path: Path) -> FakeSysfs:
    return FakeSysfs.build(tmp_path, [Dev(GPU, iommu_group=12)])


def _driver(fake: FakeSysfs) -> str | None:
    f = fake.host().function(ADDR)
    assert f is not None
    return f.driver


def test_bind_writes_override_then_unbinds_the_old_driver_then_probes(fake: FakeSysfs) -> None:
    fake.host().bind(ADDR, "vfio-pci")
    assert fake.write_log() == [
        f"bus/pci/devices/{GPU}/driver_override=vfio-pci",
        f"bus/pci/drivers/nvidia/unbind={GPU}",
        f"bus/pci/drivers_probe={GPU}",
    ]
    assert not any("new_id" in w or w.startswith("bus/pci/drivers/vfio-pci/bind") for w in fake.write_log())
    f = fake.host().function(ADDR)
    assert f is not None and (f.driver, f.driver_override) == ("vfio-pci", "vfio-pci")
    assert (fake.sys / "bus/pci/drivers/vfio-pci" / GPU).is_symlink()
    assert not (fake.sys / "bus/pci/drivers/nvidia" / GPU).exists()


def test_binding_a_device_already_on_the_driver_only_pins_it(fake: FakeSysfs) -> None:
    host = fake.host()
    host.bind(ADDR, "vfio-pci")
    fake.writes.clear()
    host.bind(ADDR, "vfio-pci")
    assert fake.write_log() == []


def test_an_unbound_device_is_probed_without_an_unbind(tmp_path: Path) -> None:
    fake = FakeSysfs.build(tmp_path, [Dev(GPU, iommu_group=12, driver=None)])
    fake.host().bind(ADDR, "vfio-pci")
    assert fake.write_log() == [f"bus/pci/devices/{GPU}/driver_override=vfio-pci", f"bus/pci/drivers_probe={GPU}"]


def test_a_probe_that_binds_nothing_is_a_bind_failure(fake: FakeSysfs) -> None:
    fake.probe_ignored.add(GPU)
    with pytest.raises(HostError) as e:
        fake.host().bind(ADDR, "vfio-pci")
    assert e.value.code == "host.bind_failed"
    assert _driver(fake) is None


def test_restore_clears_the_override_and_hands_back_to_the_original_driver(fake: FakeSysfs) -> None:
    host = fake.host()
    host.bind(ADDR, "vfio-pci")
    fake.writes.clear()
    host.restore_driver(ADDR, "nvidia")
    assert fake.write_log() == [
        f"bus/pci/devices/{GPU}/driver_override=",
        f"bus/pci/drivers/vfio-pci/unbind={GPU}",
        f"bus/pci/drivers_probe={GPU}",
    ]
    f = host.function(ADDR)
    assert f is not None and (f.driver, f.driver_override) == ("nvidia", None)


def test_restore_to_no_driver_leaves_the_device_unbound(fake: FakeSysfs) -> None:
    host = fake.host()
    host.bind(ADDR, "vfio-pci")
    host.restore_driver(ADDR, None)
    assert fake.write_log()[-1] == f"bus/pci/drivers/vfio-pci/unbind={GPU}"
    assert _driver(fake) is None


def test_reset_writes_one_and_a_kernel_refusal_is_reset_failed(fake: FakeSysfs) -> None:
    host = fake.host()
    host.reset(ADDR)
    assert fake.write_log() == [f"bus/pci/devices/{GPU}/reset=1"]
    fake.reset_fails.add(GPU)
    with pytest.raises(HostError) as e:
        host.reset(ADDR)
    assert e.value.code == "host.reset_failed" and "Input/output error" in e.value.message


def test_a_function_without_reset_method_has_no_reset_attribute_and_reset_fails(tmp_path: Path) -> None:
    fake = FakeSysfs.build(tmp_path, [Dev(GPU, reset_method=())])
    with pytest.raises(HostError) as e:
        fake.host().reset(ADDR)
    assert e.value.code == "host.no_reset_method"  # not ENOENT from a write (seen on a real 6.1 kernel)
    assert "no reset method" in e.value.message and fake.writes == []
    assert not (fake.devdir(GPU) / "reset").exists(), "a write must never create an attribute"


def test_restore_to_a_driver_without_an_id_table_binds_it_by_override(tmp_path: Path) -> None:
    """uio_pci_generic / pci-stub match no device by id: clearing the override left the device unbound."""
    fake = FakeSysfs.build(tmp_path, [Dev(GPU, iommu_group=12, driver="uio_pci_generic", native=None)])
    fake.add_driver("uio_pci_generic")
    host = fake.host()
    host.bind(ADDR, "vfio-pci")
    fake.writes.clear()
    host.restore_driver(ADDR, "uio_pci_generic")
    assert fake.write_log() == [
        f"bus/pci/devices/{GPU}/driver_override=",
        f"bus/pci/drivers/vfio-pci/unbind={GPU}",
        f"bus/pci/drivers_probe={GPU}",
        f"bus/pci/devices/{GPU}/driver_override=uio_pci_generic",
        f"bus/pci/drivers_probe={GPU}",
    ]
    f = host.function(ADDR)
    assert f is not None and (f.driver, f.driver_override) == ("uio_pci_generic", "uio_pci_generic")


def test_read_only_host_refuses_every_write_before_touching_files(fake: FakeSysfs) -> None:
    host = fake.host(read_only=True)
    before = (fake.devdir(GPU) / "driver_override").read_text()
    actions: list[Callable[[], object]] = [
        lambda: host.bind(ADDR, "vfio-pci"),
        lambda: host.reset(ADDR),
        lambda: host.restore_driver(ADDR, "nvidia"),
    ]
    for action in actions:
        with pytest.raises(HostError) as e:
            action()
        assert e.value.code == "host.read_only"
    assert fake.writes == []
    assert (fake.devdir(GPU) / "driver_override").read_text() == before
    assert _driver(fake) == "nvidia"


def test_writes_to_a_missing_device_say_device_missing(fake: FakeSysfs) -> None:
    fake.remove_device(GPU)
    with pytest.raises(HostError) as e:
        fake.host().bind(ADDR, "vfio-pci")
    assert e.value.code == "host.device_missing"
    assert fake.writes == []


@pytest.mark.parametrize(
    "text",
    ["../../../etc", "0000:3b:00.0/../..", "0000:3b:00.0\n", "0000:3b:00.0 ", " 0000:3b:00.0", "0000:3b:00.0x",
     "0000:3b:00.8", "0000:3b:20.0", "0000:3b:00", "00000:3b:00.0", "0000:3b:00.0" * 50, "", "..", "/sys"],
)  # fmt: skip
def test_path_injection_in_an_address_never_reaches_sysfs(fake: FakeSysfs, text: str) -> None:
    with pytest.raises(CubeError) as e:
        PciAddress.parse(text)
    assert e.value.code == "device.invalid_address"


def test_uppercase_addresses_are_normalised_to_the_kernel_spelling(fake: FakeSysfs) -> None:
    address = PciAddress.parse("0000:3B:00.0")
    host = fake.host()
    assert host.device_path(address).name == GPU
    assert host.function(address) is not None


def test_only_validated_addresses_and_fixed_attributes_become_paths(fake: FakeSysfs) -> None:
    host = fake.host()
    for bad in ("0000:3b:00.0", "../../..", Path("/etc")):
        with pytest.raises(CubeError) as e:
            host.device_path(bad, "vendor")  # type: ignore[arg-type]
        assert e.value.code == "device.invalid_address"
    for attr in ("../../../etc/passwd", "new_id", "remove", "sriov_numvfs/..", "vendor\n"):
        with pytest.raises(CubeError) as e:
            host.device_path(ADDR, attr)
        assert e.value.code == "host.invalid_attribute"
    with pytest.raises(CubeError) as e:
        host.driver_path("nvidia", "new_id")
    assert e.value.code == "host.invalid_attribute"
    for driver in ("../../../../tmp/x", "vfio-pci\nnvidia", ""):
        with pytest.raises(CubeError) as e:
            host.bind(ADDR, driver)
        assert e.value.code == "host.invalid_driver_name"
    with pytest.raises(CubeError):
        host.iommu_group_members(-1)
    assert fake.writes == []


def test_an_attribute_that_is_a_symlink_is_not_written_through(fake: FakeSysfs, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("untouched\n")
    reset = fake.devdir(GPU) / "reset"
    reset.unlink()
    reset.symlink_to(victim)
    host = SysfsPciHost(fake.sys, proc_root=fake.proc, dev_root=fake.dev)
    with pytest.raises(HostError):
        host.reset(ADDR)
    assert victim.read_text() == "untouched\n"
