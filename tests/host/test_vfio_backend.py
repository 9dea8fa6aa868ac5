"""The VFIO backend on a fake sysfs tree: discovery, group viability, preparation, health, cleanup."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from cubeaccel.backends.base import Problem
from cubeaccel.backends.vfio import VfioBackend
from cubeaccel.model.device import AcceleratorClass, DeviceRecord, DiscoveredDevice, PciAddress
from cubeaccel.model.states import DeviceState
from cubeaccel.protocol.errors import CubeError
from tests.support.fake_sysfs import Dev, FakeSysfs
from tests.support.holder_proc import holding, unreadable_pids

GPU = "0000:3b:00.0"
AUDIO = "0000:3b:00.1"
PORT = "0000:3a:00.0"
GPU2 = "0000:5e:00.0"
NVSWITCH = "0000:7a:00.0"


def _tree(
    tmp_path: Path, gpu_driver: str | None = "vfio-pci", audio_driver: str | None = "vfio-pci", nvswitch: bool = False
) -> FakeSysfs:
    """A PCIe GPU host; with `nvswitch`, an NVSwitch beside the GPUs (an HGX node: its GPUs are held, see
    test_nvswitch.py), for discovery only."""
    return FakeSysfs.build(
        tmp_path,
        [
            Dev(PORT, vendor=0x8086, device=0x352A, class_code=0x060400, driver="pcieport", native="pcieport",
                iommu_group=12, aer_fatal=None, reset_method=()),
            Dev(GPU, parent=PORT, iommu_group=12, driver=gpu_driver, serial=0xA1),
            Dev(AUDIO, parent=PORT, device=0x22A3, class_code=0x040300, iommu_group=12, driver=audio_driver,
                native="snd_hda_intel"),
            Dev(GPU2, device=0x2335, iommu_group=30, driver="vfio-pci", numa_node=1),
            *([Dev(NVSWITCH, device=0x22A3, class_code=0x068000, iommu_group=40, driver=None, native=None)]
              if nvswitch else []),
        ],
    )  # fmt: skip


def _record(d: DiscoveredDevice, state: DeviceState = DeviceState.ALLOCATABLE) -> DeviceRecord:
    return DeviceRecord(
        id=d.device_id, address=d.address, identity=d.identity, accel_class=d.accel_class, backend=d.backend,
        numa_node=d.numa_node, iommu_group=d.iommu_group, expected_driver="vfio-pci", labels=d.labels,
        state=state, generation=1, reason=None, sandbox_id=None, updated_at=0.0,
    )  # fmt: skip


def _device(backend: VfioBackend, address: str, state: DeviceState = DeviceState.ALLOCATABLE) -> DeviceRecord:
    (d,) = [d for d in backend.discover() if str(d.address) == address]
    return _record(d, state)


def _codes(problems: Sequence[Problem]) -> list[str]:
    return [p.code for p in problems]


def test_discovery_takes_gpus_by_class_not_their_audio_or_nvswitch(tmp_path: Path) -> None:
    backend = VfioBackend(_tree(tmp_path, nvswitch=True).host())
    found = {str(d.address): d for d in backend.discover()}
    assert sorted(found) == [GPU, GPU2]
    h200 = found[GPU2]
    assert h200.accel_class == AcceleratorClass.GPU
    assert (h200.labels["model"], h200.labels["memory_gib"], h200.labels["numa_node"]) == ("H200-SXM-141GB", "141", "1")
    assert (h200.iommu_group, h200.driver) == (30, "vfio-pci")
    assert found[GPU].identity.serial == "00-00-00-00-00-00-00-a1"


def test_allow_list_patterns(tmp_path: Path) -> None:
    host = _tree(tmp_path, nvswitch=True).host()
    assert [str(d.address) for d in VfioBackend(host, allow=["10de:2335"]).discover()] == [GPU2]
    assert [str(d.address) for d in VfioBackend(host, allow=["10de:*@0000:3b:*"]).discover()] == [GPU]
    assert VfioBackend(host, allow=["1af4:*"]).discover() == []
    # naming the exact id admits a non-accelerator class, but never a bridge
    exact = VfioBackend(host, allow=["10de:22a3"]).discover()
    assert [(str(d.address), d.accel_class) for d in exact] == [(AUDIO, AcceleratorClass.ACCELERATOR)]
    for bad in ["10de", "10de:*/..", "10DE:2335\n", "*:*@../../x", "10de:23350", ""]:
        with pytest.raises(CubeError) as e:
            VfioBackend(host, allow=[bad])
        assert e.value.code == "backend.invalid_allow_pattern"


def test_a_viable_group_validates_clean_and_bridges_do_not_count(tmp_path: Path) -> None:
    backend = VfioBackend(_tree(tmp_path).host())
    assert backend.validate(_device(backend, GPU)) == []


def test_non_viable_group_names_the_offending_functions(tmp_path: Path) -> None:
    backend = VfioBackend(_tree(tmp_path, audio_driver="snd_hda_intel").host())
    problems = backend.validate(_device(backend, GPU))
    assert _codes(problems) == ["backend.iommu_group_not_viable"]
    assert f"{AUDIO}(snd_hda_intel)" in problems[0].message and PORT not in problems[0].message
    assert backend.group_offenders(backend.host.function(PciAddress.parse(GPU))) == [f"{AUDIO}(snd_hda_intel)"]  # type: ignore[arg-type]


def test_no_iommu_group_is_a_problem(tmp_path: Path) -> None:
    fake = FakeSysfs.build(tmp_path, [Dev(GPU, iommu_group=None, driver="vfio-pci")], iommu=False)
    backend = VfioBackend(fake.host())
    assert _codes(backend.validate(_device(backend, GPU))) == ["backend.no_iommu_group"]


def test_prepare_binds_through_override_and_returns_the_original_driver(tmp_path: Path) -> None:
    fake = _tree(tmp_path, gpu_driver="nvidia")
    backend = VfioBackend(fake.host())
    device = _device(backend, GPU, DeviceState.INITIALIZED)
    prep = backend.prepare(device)
    assert (prep.ok, prep.original_driver, prep.changed) == (True, "nvidia", True)
    assert fake.write_log() == [
        f"bus/pci/devices/{GPU}/driver_override=vfio-pci",
        f"bus/pci/drivers/nvidia/unbind={GPU}",
        f"bus/pci/drivers_probe={GPU}",
    ]
    assert backend.validate(device) == []
    again = backend.prepare(device)
    assert (again.changed, again.original_driver) == (False, "vfio-pci")
    assert len(fake.writes) == 3

    assert backend.restore_host(device, prep.original_driver) == []
    f = backend.host.function(device.address)
    assert f is not None and (f.driver, f.driver_override) == ("nvidia", None)
    assert fake.write_log()[3:] == [
        f"bus/pci/devices/{GPU}/driver_override=",
        f"bus/pci/drivers/vfio-pci/unbind={GPU}",
        f"bus/pci/drivers_probe={GPU}",
    ]
    assert not any("new_id" in w for w in fake.write_log())


def test_prepare_refuses_a_device_someone_holds_open(tmp_path: Path) -> None:
    fake = _tree(tmp_path, gpu_driver="nvidia")
    dev = Path(os.path.realpath(fake.dev))
    (dev / "vfio" / "12").write_text("")
    host = fake.host()
    host.proc_root, host.dev_root = Path("/proc"), dev
    backend = VfioBackend(host)
    device = _device(backend, GPU, DeviceState.INITIALIZED)
    with holding(dev / "vfio" / "12"):
        prep = backend.prepare(device)
    assert _codes(prep.problems) == ["host.device_held"] and not prep.problems[0].hard
    assert prep.original_driver == "nvidia"
    assert fake.writes == []


def test_prepare_refuses_when_vfio_pci_is_missing(tmp_path: Path) -> None:
    fake = FakeSysfs.build(tmp_path, [Dev(GPU, iommu_group=12)], drivers=("nvidia",))
    backend = VfioBackend(fake.host())
    prep = backend.prepare(_device(backend, GPU, DeviceState.INITIALIZED))
    assert _codes(prep.problems) == ["backend.vfio_unavailable"] and fake.writes == []
    assert VfioBackend(fake.host(), allow=["10DE:2330"]).allow == ("10de:2330",)


def test_the_boot_vga_device_is_never_unbound(tmp_path: Path) -> None:
    fake = FakeSysfs.build(tmp_path, [Dev(GPU, iommu_group=12, class_code=0x030000, boot_vga=True)])
    backend = VfioBackend(fake.host())
    prep = backend.prepare(_device(backend, GPU, DeviceState.INITIALIZED))
    assert _codes(prep.problems) == ["backend.boot_vga"] and fake.writes == []


def test_device_vanished_while_attached_is_reported_missing(tmp_path: Path) -> None:
    fake = _tree(tmp_path)
    backend = VfioBackend(fake.host())
    device = _device(backend, GPU2, DeviceState.ATTACHED)
    assert backend.health(device) == []
    fake.remove_device(GPU2)
    problems = backend.health(device)
    assert _codes(problems) == ["host.device_missing"] and problems[0].hard
    assert _codes(backend.cleanup(device)) == ["host.device_missing"]
    assert fake.writes == []


def test_identity_changed_at_the_same_address(tmp_path: Path) -> None:
    fake = _tree(tmp_path)
    backend = VfioBackend(fake.host())
    device = _device(backend, GPU2)
    fake.change_identity(GPU2, 0x2330)
    problems = backend.health(device)
    assert _codes(problems) == ["host.identity_changed"]
    assert "10de:2330" in problems[0].message and "10de:2335" in problems[0].message
    assert _codes(backend.validate(device)) == ["host.identity_changed"]


def test_cleanup_resets_and_verifies(tmp_path: Path) -> None:
    fake = _tree(tmp_path)
    backend = VfioBackend(fake.host())
    device = _device(backend, GPU2, DeviceState.RELEASING)
    assert backend.cleanup(device) == []
    # rung 1: the kernel may use only the function's own reset for this write, then its list is written back
    assert fake.write_log() == [
        f"bus/pci/devices/{GPU2}/reset_method=flr",
        f"bus/pci/devices/{GPU2}/reset=1",
        f"bus/pci/devices/{GPU2}/reset_method=flr bus",
    ]
    assert fake.resets == {GPU2: 1} and fake.reset_log == [(GPU2, "flr")]


def test_reset_failure_is_soft_so_the_device_is_quarantined(tmp_path: Path) -> None:
    fake = _tree(tmp_path)
    fake.reset_fails.add(GPU2)
    backend = VfioBackend(fake.host())
    problems = backend.cleanup(_device(backend, GPU2, DeviceState.RELEASING))
    assert _codes(problems) == ["backend.reset_failed"] and not problems[0].hard
    assert "Input/output error" in problems[0].message


def test_a_device_that_stops_answering_after_reset_fails_cleanup(tmp_path: Path) -> None:
    fake = _tree(tmp_path)
    fake.reset_kills.add(GPU2)
    backend = VfioBackend(fake.host())
    problems = backend.cleanup(_device(backend, GPU2, DeviceState.RELEASING))
    assert _codes(problems) == ["backend.reset_failed"] and "stopped answering" in problems[0].message


def test_a_different_device_after_reset_fails_cleanup(tmp_path: Path) -> None:
    fake = _tree(tmp_path)
    fake.after_reset[GPU2] = 0x2330
    backend = VfioBackend(fake.host())
    assert _codes(backend.cleanup(_device(backend, GPU2, DeviceState.RELEASING))) == ["host.identity_changed"]


def test_reset_only_through_allowed_methods(tmp_path: Path) -> None:
    fake = FakeSysfs.build(tmp_path, [Dev(GPU, iommu_group=12, driver="vfio-pci", reset_method=("bus",))])
    backend = VfioBackend(fake.host(), reset_methods={"flr"})
    problems = backend.cleanup(_device(backend, GPU, DeviceState.RELEASING))
    assert _codes(problems) == ["backend.reset_not_allowed"] and not problems[0].hard
    assert fake.writes == []


def test_aer_fatal_counter_is_compared_with_its_baseline(tmp_path: Path) -> None:
    fake = FakeSysfs.build(tmp_path, [Dev(GPU, iommu_group=12, driver="vfio-pci", aer_fatal=2)])
    backend = VfioBackend(fake.host())
    device = _device(backend, GPU)
    assert _codes(backend.health(device)) == ["host.aer_fatal"], "no baseline yet: any fatal error counts"
    assert backend.validate(device) == []
    assert backend.aer_baseline(device.address) == 2
    assert backend.health(device) == []
    fake.set_aer_fatal(GPU, 3)
    problems = backend.health(device)
    assert _codes(problems) == ["host.aer_fatal"] and problems[0].hard and "1 new" in problems[0].message
    assert _codes(backend.cleanup(device)) == ["host.aer_fatal"]


def test_wrong_driver_is_a_health_problem(tmp_path: Path) -> None:
    fake = _tree(tmp_path)
    backend = VfioBackend(fake.host())
    device = _device(backend, GPU2)
    fake.host().restore_driver(PciAddress.parse(GPU2), "nvidia")
    assert _codes(backend.health(device)) == ["backend.wrong_driver"]


def _held_tree(tmp_path: Path) -> tuple[FakeSysfs, VfioBackend, Path]:
    fake = _tree(tmp_path)
    dev = Path(os.path.realpath(fake.dev))
    group_file = dev / "vfio" / "30"
    group_file.write_text("")
    host = fake.host()
    host.proc_root, host.dev_root = Path("/proc"), dev
    host.exempt_pids = unreadable_pids()
    return fake, VfioBackend(host), group_file


def test_holder_that_never_exits_ends_in_a_soft_problem_after_the_deadline(tmp_path: Path) -> None:
    _, backend, group_file = _held_tree(tmp_path)
    device = _device(backend, GPU2, DeviceState.RELEASING)
    with holding(group_file) as proc:
        start = time.monotonic()
        problems = backend.wait_released(device, timeout_s=0.5, poll_s=0.05)
        waited = time.monotonic() - start
        assert _codes(problems) == ["host.device_held"] and not problems[0].hard
        assert str(proc.pid) in problems[0].message and str(group_file) in problems[0].message
        assert 0.5 <= waited < 5
        assert _codes(backend.health(_device(backend, GPU2, DeviceState.ALLOCATABLE))) == ["host.unexpected_holder"]
        assert backend.health(_device(backend, GPU2, DeviceState.ATTACHED)) == []
        assert "host.device_held" in _codes(backend.validate(device))


def test_a_holder_that_exits_releases_the_device(tmp_path: Path) -> None:
    _, backend, group_file = _held_tree(tmp_path)
    device = _device(backend, GPU2, DeviceState.RELEASING)
    with holding(group_file) as proc:
        assert [h.pid for h in backend.holders(device)] == [proc.pid]
        proc.kill()
        proc.wait(timeout=10)
        assert backend.wait_released(device, timeout_s=10) == []


def test_attach_spec_names_the_host_address(tmp_path: Path) -> None:
    backend = VfioBackend(_tree(tmp_path).host())
    spec = backend.attach_spec(_device(backend, GPU2))
    assert (spec.driver, spec.properties) == ("vfio-pci", {"host": GPU2})


# ---- defects a real 6.1 VFIO stack showed (tests/lab): the same facts in a fake tree -------------------------------
def test_prepare_without_an_iommu_group_writes_nothing_and_names_the_group(tmp_path: Path) -> None:
    fake = FakeSysfs.build(tmp_path, [Dev(GPU, iommu_group=None)], iommu=False)
    backend = VfioBackend(fake.host())
    prep = backend.prepare(_device(backend, GPU))
    assert _codes(prep.problems) == ["backend.no_iommu_group"] and "iommu_group" in prep.problems[0].message
    assert not prep.changed and fake.writes == []  # was: unbound from nvidia, then `bind_failed`


def test_cleanup_of_a_function_without_a_reset_method_is_a_clear_soft_problem(tmp_path: Path) -> None:
    fake = FakeSysfs.build(tmp_path, [Dev(GPU, iommu_group=12, driver="vfio-pci", reset_method=())])
    backend = VfioBackend(fake.host())
    (p,) = backend.cleanup(_device(backend, GPU, DeviceState.RELEASING))
    assert (p.code, p.hard) == ("backend.no_reset_method", False)
    assert fake.writes == []


def _vfio_dev(fake: FakeSysfs, address: str, n: int, with_node: bool) -> None:
    (fake.devdir(address) / "vfio-dev" / f"vfio{n}").mkdir(parents=True)
    if with_node:
        (fake.dev / "vfio" / "devices").mkdir(parents=True, exist_ok=True)
        (fake.dev / "vfio" / "devices" / f"vfio{n}").write_text("")


def test_device_files_name_the_vfio_cdev_only_where_the_kernel_made_it(tmp_path: Path) -> None:
    fake = FakeSysfs.build(tmp_path, [Dev(GPU, iommu_group=12, driver="vfio-pci"), Dev(GPU2, iommu_group=30)])
    _vfio_dev(fake, GPU, 0, with_node=False)  # Linux 6.1..6.5: sysfs vfio-dev/vfio0, no /dev node
    _vfio_dev(fake, GPU2, 1, with_node=True)  # 6.6+
    host = fake.host()
    assert host.device_files(PciAddress.parse(GPU)) == [str(fake.dev / "vfio" / "12")]
    assert host.device_files(PciAddress.parse(GPU2)) == [
        str(fake.dev / "vfio" / "30"),
        str(fake.dev / "vfio" / "devices" / "vfio1"),
    ]


def _fd(fake: FakeSysfs, pid: int, comm: str, target: str) -> None:
    (fake.proc / str(pid) / "fd").mkdir(parents=True)
    (fake.proc / str(pid) / "comm").write_text(comm + "\n")
    (fake.proc / str(pid) / "fd" / "7").symlink_to(target)


def test_an_open_vfio_device_fd_without_its_group_fd_is_a_holder(tmp_path: Path) -> None:
    fake = FakeSysfs.build(tmp_path, [Dev(GPU, iommu_group=12, driver="vfio-pci")])
    backend = VfioBackend(fake.host())
    device = _device(backend, GPU)
    (fake.devdir(GPU) / "enable").write_text("1\n")  # vfio-pci enabled it: some device fd is open
    _fd(fake, 4242, "qemu-system-x86", "anon_inode:[vfio-device]")
    assert [(h.pid, h.path, h.unknown) for h in backend.holders(device)] == [(4242, "anon_inode:[vfio-device]", False)]
    assert "host.device_held" in _codes(backend.validate(device))
    assert _codes(backend.wait_released(device, 0.0)) == ["host.device_held"]


def test_an_open_device_fd_outside_our_pid_namespace_is_an_unknown_holder(tmp_path: Path) -> None:
    fake = FakeSysfs.build(tmp_path, [Dev(GPU, iommu_group=12, driver="vfio-pci")])
    backend = VfioBackend(fake.host())
    (fake.devdir(GPU) / "enable").write_text("1\n")  # and no process here has any fd for it
    (h,) = backend.holders(_device(backend, GPU))
    assert (h.pid, h.unknown) == (0, True) and "enable=1" in h.path


def test_the_enable_count_of_a_device_on_another_driver_is_not_a_holder(tmp_path: Path) -> None:
    fake = FakeSysfs.build(tmp_path, [Dev(GPU, iommu_group=12, driver="nvidia")])
    (fake.devdir(GPU) / "enable").write_text("1\n")  # nvidia enables its devices while bound
    assert fake.host().holders(PciAddress.parse(GPU)) == []


def test_an_exempt_unreadable_process_does_not_hide_the_open_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeSysfs.build(tmp_path, [Dev(GPU, iommu_group=12, driver="vfio-pci")])
    (fake.devdir(GPU) / "enable").write_text("1\n")
    (fake.proc / "1" / "fd").mkdir(parents=True)
    real_scandir = os.scandir

    def scandir(path: object) -> object:
        if str(path) == str(fake.proc / "1" / "fd"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)  # type: ignore[call-overload]

    monkeypatch.setattr(os, "scandir", scandir)
    host = fake.host()
    host.exempt_pids = frozenset({1})  # an unreadable pid 1 the operator declared harmless
    (h,) = host.holders(PciAddress.parse(GPU))
    assert (h.pid, h.unknown) == (0, True)
