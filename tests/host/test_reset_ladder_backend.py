"""The reset ladder through the VFIO backend on a fake sysfs tree (the rule itself: tests/unit/test_reset_ladder.py).

Rung 1 the function's own reset, rung 2 a bus reset only when everything it reaches is in the device's IOMMU group
and idle, rung 3 quarantine; after each rung the identity and health check decides whether the next one runs.
"""

from __future__ import annotations

from pathlib import Path

from cubeaccel.backends.base import ResetContext
from cubeaccel.backends.vfio import VfioBackend
from cubeaccel.model.device import DeviceRecord, PciAddress
from cubeaccel.model.reset_ladder import Rung
from cubeaccel.model.states import DeviceState
from tests.support.fake_sysfs import Dev, FakeSysfs, _resource_line
from tests.support.holder_proc import holding

PORT = "0000:3a:00.0"
GPU = "0000:3b:00.0"
SIBLING = "0000:3b:00.1"
ROOT_GPU = "0000:5e:00.0"


def _tree(tmp_path: Path, sibling_group: int = 12, sibling_driver: str | None = "vfio-pci", **gpu: object) -> FakeSysfs:
    return FakeSysfs.build(
        tmp_path,
        [
            Dev(PORT, vendor=0x8086, device=0x352A, class_code=0x060400, driver="pcieport", native="pcieport",
                iommu_group=11, aer_fatal=None, reset_method=()),
            Dev(GPU, parent=PORT, iommu_group=12, driver="vfio-pci", **gpu),  # type: ignore[arg-type]
            Dev(SIBLING, parent=PORT, device=0x22A3, class_code=0x040300, iommu_group=sibling_group,
                driver=sibling_driver, native="snd_hda_intel"),
            Dev(ROOT_GPU, device=0x2335, iommu_group=30, driver="vfio-pci"),
        ],
    )  # fmt: skip


def _device(backend: VfioBackend, address: str) -> DeviceRecord:
    (d,) = [d for d in backend.discover() if str(d.address) == address]
    return DeviceRecord(
        id=d.device_id, address=d.address, identity=d.identity, accel_class=d.accel_class, backend=d.backend,
        numa_node=d.numa_node, iommu_group=d.iommu_group, expected_driver="vfio-pci", labels=d.labels,
        state=DeviceState.RELEASING, generation=1, reason=None, sandbox_id=None, updated_at=0.0,
    )  # fmt: skip


def test_bus_reach_is_every_function_under_the_bridge_above_and_none_on_a_root_bus(tmp_path: Path) -> None:
    host = _tree(tmp_path).host()
    assert host.bus_reach(PciAddress.parse(GPU)) == [PciAddress.parse(GPU), PciAddress.parse(SIBLING)]
    assert host.bus_reach(PciAddress.parse(ROOT_GPU)) is None


def test_flr_that_did_not_take_is_followed_by_a_bus_reset_within_the_group(tmp_path: Path) -> None:
    fake = _tree(tmp_path)
    fake.flr_ineffective.add(GPU)
    backend = VfioBackend(fake.host(), allow=["10de:2331"])
    result = backend.reset_ladder(_device(backend, GPU), ResetContext())
    assert result.problems == []
    assert fake.reset_log == [(GPU, "flr"), (GPU, "bus")]
    assert [(a.step.rung, a.ok) for a in result.attempts] == [(Rung.FUNCTION, False), (Rung.BUS, True)]
    assert result.attempts[0].check == ("backend.reset_failed",)
    assert (fake.devdir(GPU) / "reset_method").read_text().strip() == "flr bus"  # the function's own list is back


def test_bus_reset_reaching_a_function_of_another_group_is_refused_and_names_it(tmp_path: Path) -> None:
    fake = _tree(tmp_path, sibling_group=13)
    fake.flr_ineffective.add(GPU)
    backend = VfioBackend(fake.host(), allow=["10de:2331"])
    result = backend.reset_ladder(_device(backend, GPU), ResetContext())
    (p,) = result.problems
    assert (p.code, p.hard) == ("backend.bus_reset_refused", False)
    assert f"{SIBLING}(IOMMU group 13, not 12)" in p.message
    assert fake.reset_log == [(GPU, "flr")]  # no bus reset was written
    assert result.attempts[-1].step.refused == (f"{SIBLING}(IOMMU group 13, not 12)",)


def test_bus_reset_reaching_a_busy_function_of_the_same_group_is_refused(tmp_path: Path) -> None:
    fake = _tree(tmp_path, reset_method=("bus",))
    backend = VfioBackend(fake.host(), allow=["10de:2331"])
    reserved = {PciAddress.parse(SIBLING): "attached to sandbox sb-2"}
    (p,) = backend.reset_ladder(_device(backend, GPU), ResetContext(reserved=reserved)).problems
    assert p.code == "backend.bus_reset_refused" and f"{SIBLING}(attached to sandbox sb-2)" in p.message
    assert fake.resets == {}


def test_bus_reset_reaching_a_function_held_open_is_refused(tmp_path: Path) -> None:
    fake = _tree(tmp_path, reset_method=("bus",))
    host = fake.host()
    host.proc_root = Path("/proc")  # the real /proc, where the holder process runs
    group_file = fake.dev / "vfio" / "12"
    group_file.parent.mkdir(parents=True, exist_ok=True)
    group_file.touch()
    backend = VfioBackend(host, allow=["10de:2331"])
    with holding(group_file):
        (p,) = backend.reset_ladder(_device(backend, GPU), ResetContext()).problems
    assert p.code == "backend.bus_reset_refused" and "held by" in p.message
    assert fake.resets == {}


def test_bus_reset_reaching_a_function_on_a_host_driver_is_refused(tmp_path: Path) -> None:
    fake = _tree(tmp_path, sibling_driver="snd_hda_intel", reset_method=("bus",))
    backend = VfioBackend(fake.host(), allow=["10de:2331"])
    (p,) = backend.reset_ladder(_device(backend, GPU), ResetContext()).problems
    assert p.code == "backend.bus_reset_refused" and f"{SIBLING}(bound to snd_hda_intel)" in p.message


def test_a_device_on_a_root_bus_whose_flr_did_not_take_is_quarantined(tmp_path: Path) -> None:
    fake = _tree(tmp_path)
    fake.flr_ineffective.add(ROOT_GPU)
    backend = VfioBackend(fake.host())
    (p,) = backend.cleanup(_device(backend, ROOT_GPU))
    assert (p.code, p.hard) == ("backend.reset_failed", False) and "root bus" in p.message
    assert fake.reset_log == [(ROOT_GPU, "flr")]


def test_nvidia_gpu_after_an_unclean_vmm_exit_starts_at_the_bus_rung(tmp_path: Path) -> None:
    fake = _tree(tmp_path)
    backend = VfioBackend(fake.host(), allow=["10de:2331"])
    device = _device(backend, GPU)
    result = backend.reset_ladder(device, ResetContext(unclean_exit=True))
    assert result.problems == [] and fake.reset_log == [(GPU, "bus")]
    assert backend.reset_ladder(device, ResetContext()).problems == []  # a clean exit: FLR
    assert fake.reset_log[-1] == (GPU, "flr")


def test_nvidia_preference_falls_back_to_flr_when_the_bus_reset_is_refused(tmp_path: Path) -> None:
    fake = _tree(tmp_path, sibling_group=13)
    backend = VfioBackend(fake.host(), allow=["10de:2331"])
    result = backend.reset_ladder(_device(backend, GPU), ResetContext(unclean_exit=True))
    assert result.problems == [] and fake.reset_log == [(GPU, "flr")]
    assert result.attempts[0].step.refused == (f"{SIBLING}(IOMMU group 13, not 12)",)


def test_bars_that_changed_across_the_reset_fail_the_check(tmp_path: Path) -> None:
    fake = _tree(tmp_path, reset_method=("flr",))
    backend = VfioBackend(fake.host(), allow=["10de:2331"])
    device = _device(backend, GPU)
    resource = fake.devdir(GPU) / "resource"
    lines = resource.read_text().splitlines(keepends=True)
    resource.write_text(_resource_line(0, 8 << 20) + "".join(lines[1:]))  # BAR0 16 MiB → 8 MiB
    (p,) = backend.cleanup(device)
    assert p.code == "backend.reset_check_failed" and "BARs" in p.message


def test_a_device_enabled_after_its_reset_fails_the_check(tmp_path: Path) -> None:
    fake = _tree(tmp_path, reset_method=("flr",))
    (fake.devdir(GPU) / "enable").write_text("1\n")
    backend = VfioBackend(fake.host(), allow=["10de:2331"])
    (p,) = backend.cleanup(_device(backend, GPU))
    assert p.code == "backend.reset_check_failed" and "enable reads 1" in p.message
