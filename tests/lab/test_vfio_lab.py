"""cubeaccel's real VfioBackend + SysfsPciHost against a real kernel VFIO stack (the lab guest, emulated VT-d).

One boot runs every backend scenario (tests/lab/guest/scenarios.py); each test asserts one scenario's observations.
Topology: RC = edu on the root complex (no reset method), RP = edu behind a pcie-root-port (bus reset), MF0/MF1 = a
multifunction pair sharing one IOMMU group.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.lab.harness import BootResult, LabImage, boot

pytestmark = pytest.mark.vm

RC, RP, MF0, MF1 = "0000:00:03.0", "0000:01:00.0", "0000:00:05.0", "0000:00:05.1"
PLAN = [
    "readiness",
    "discovery",
    "prepare",
    "device_files",
    "validate",
    "group_viability",
    "holder_full",
    "holder_device_fd_only",
    "holder_other_pidns",
    "cleanup_bus_reset",
    "cleanup_no_reset",
    "restore_host",
]


@pytest.fixture(scope="module")
def lab(lab_image: LabImage, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BootResult]:
    yield boot(lab_image, tmp_path_factory.mktemp("lab-boot"), PLAN)


def codes(problems: list[dict[str, Any]]) -> list[str]:
    return [p["code"] for p in problems]


def test_lab_boot_is_fast_enough_for_ci(lab: BootResult) -> None:
    elapsed = {name: r.get("elapsed_s") for name, r in lab.results.items()}
    print(f"lab boot: ready {lab.ready_s:.1f} s, done {lab.total_s:.1f} s, attempts {lab.attempts}; {elapsed}")
    assert lab.attempts <= 2
    assert lab.ready_s < 60 and lab.total_s < 120, (lab.ready_s, lab.total_s)


def test_readiness_passes_everything_but_virtualization_under_tcg(lab: BootResult) -> None:
    r = lab.scenario("readiness")
    assert r["kernel"].startswith("6.1.")
    for name in ("iommu", "vfio_pci", "vfio_container", "interrupt_remapping"):
        assert r["checks"][name]["status"] == "pass", (name, r["checks"])
    assert r["checks"]["virtualization"] == {"status": "fail", "code": "host.no_kvm"}
    assert r["backend_failures"] == ["host.no_kvm"]


def test_discovery_sees_the_topology_with_real_iommu_groups(lab: BootResult) -> None:
    devices = lab.scenario("discovery")["devices"]
    assert sorted(devices) == sorted([RC, RP, MF0, MF1])
    assert all(d["driver"] is None and d["class"] == "accelerator" for d in devices.values())
    assert devices[RC]["group_members"] == [RC] and not devices[RC]["has_reset_attr"]
    assert devices[RC]["reset_method"] == []
    assert devices[RP]["group_members"] == [RP] and devices[RP]["reset_method"] == ["bus"]
    assert devices[RP]["parent"] == "0000:00:04.0"
    assert devices[MF0]["iommu_group"] == devices[MF1]["iommu_group"]
    assert devices[MF0]["group_members"] == [MF0, MF1]
    assert len({devices[a]["iommu_group"] for a in (RC, RP, MF0)}) == 3


def test_prepare_binds_vfio_pci_and_the_group_file_appears(lab: BootResult) -> None:
    for address, p in lab.scenario("prepare").items():
        assert p["problems"] == [], address
        assert (p["original_driver"], p["changed"], p["driver"], p["driver_override"]) == (
            None,
            True,
            "vfio-pci",
            "vfio-pci",
        )
        assert p["group_file_exists"], p
        assert (p["again_changed"], p["again_problems"]) == (False, [])  # idempotent: no second rebind


def test_device_files_names_only_files_this_kernel_has(lab: BootResult) -> None:
    """Defect: /dev/vfio/devices/vfioN was named although that cdev only exists from Linux 6.6."""
    r = lab.scenario("device_files")
    assert not r["dev_vfio_devices_exists"]
    for address in (RC, RP, MF0, MF1):
        d = r[address]
        assert d["vfio_dev_sysfs"], "6.1 has vfio-dev/vfioN in sysfs"
        assert d["missing"] == [], d
        assert any(f.startswith("/dev/vfio/") and f[10:].isdigit() for f in d["files"]), d


def test_validate_passes_for_every_bound_idle_device(lab: BootResult) -> None:
    assert lab.scenario("validate") == {a: [] for a in (RC, RP, MF0, MF1)}


def test_a_group_member_on_another_driver_makes_the_group_not_viable(lab: BootResult) -> None:
    r = lab.scenario("group_viability")
    uio = r["uio_pci_generic"]
    assert uio["mf1_driver"] == "uio_pci_generic"
    assert codes(uio["validate_mf0"]) == ["backend.iommu_group_not_viable"]
    assert f"{MF1}(uio_pci_generic)" in uio["validate_mf0"][0]["message"]
    assert uio["kernel_viable"] is False  # the kernel agrees
    stub = r["pci-stub"]
    assert codes(stub["validate_mf0"]) == ["backend.iommu_group_not_viable"]
    assert stub["kernel_viable"] is True  # vfio trusts pci-stub; cubeaccel stays stricter (docs/vfio.md)
    assert uio["back_to_vfio"] == stub["back_to_vfio"] == []
    assert r["validate_mf0_after"] == [] and r["kernel_viable_after"] is True


def test_a_vmm_shaped_holder_is_seen_everywhere_and_released(lab: BootResult) -> None:
    r = lab.scenario("holder_full")
    assert r["idle"] == {"enable": 0, "holders": []}
    held = r["held"]
    assert {"/dev/vfio/vfio", "anon_inode:[vfio-device]"} <= set(held["fds"])
    assert [(h["pid"], h["unknown"]) for h in held["holders"]] == [(held["holder_pid"], False)]
    assert held["holders"][0]["path"].startswith("/dev/vfio/")
    assert held["enable"] == 1
    assert "host.device_held" in codes(held["validate"])
    assert codes(held["health_allocatable"]) == ["host.unexpected_holder"]
    assert held["health_attached"] == []
    assert codes(held["wait_released_short"]) == ["host.device_held"]
    assert held["second_open"] == "EBUSY"
    assert r["after"] == {"wait_released": [], "released_ms": r["after"]["released_ms"], "enable": 0, "holders": []}


def test_a_holder_with_only_the_device_fd_is_still_a_holder(lab: BootResult) -> None:
    """Defect: with the group fd closed only anon_inode:[vfio-device] remains; holders() saw nobody while the kernel
    kept the device busy (EBUSY, `enable` 1) — the release path would have reset a held device."""
    r = lab.scenario("holder_device_fd_only")
    held = r["held"]
    assert [f for f in held["fds"] if f != "/dev/console"] == ["anon_inode:[vfio-device]"]
    assert held["enable"] == 1 and held["second_open"] == "EBUSY"  # the kernel says: busy
    assert [h["pid"] for h in held["holders"]] == [held["holder_pid"]], held["holders"]
    assert "host.device_held" in codes(held["validate"])
    assert codes(held["health_allocatable"]) == ["host.unexpected_holder"]
    assert codes(held["wait_released_short"]) == ["host.device_held"]
    assert r["after"]["wait_released"] == [] and r["after"]["holders"] == [] and r["after"]["enable"] == 0


def test_holders_across_pid_namespaces(lab: BootResult) -> None:
    """Defect: a Cubelet in its own PID namespace could not see a holder outside it; the `enable` count can."""
    r = lab.scenario("holder_other_pidns")
    child = r["holder_in_child_ns"]
    assert [h["pid"] for h in child["holders"]] == [child["holder_pid"]]  # /proc of the parent namespace shows it
    for label in ("checker_in_child_ns", "checker_in_child_ns_device_fd_only"):
        seen = r[label]
        assert seen["pids_visible"] == 1 and seen["enable"] == 1, seen
        assert [(h["pid"], h["unknown"]) for h in seen["holders"]] == [(0, True)], (label, seen)
        assert seen["after"]["holders"] == [] and seen["after"]["enable"] == 0
    assert r["idle_from_child_ns"] == {"holders": [], "enable": 0, "pids_visible": 1}


def test_cleanup_with_a_bus_reset_keeps_the_identity(lab: BootResult) -> None:
    r = lab.scenario("cleanup_bus_reset")
    assert r["reset_method"] == ["bus"]
    assert r["cleanup"] == [] and r["identity_same"] and r["validate_after"] == []


def test_cleanup_without_a_reset_method_says_so(lab: BootResult) -> None:
    """Defect: a function without a reset method failed cleanup with ENOENT (writing a `reset` that is not there)."""
    r = lab.scenario("cleanup_no_reset")
    assert r["reset_method"] == [] and not r["has_reset_attr"]
    assert codes(r["cleanup"]) == ["backend.no_reset_method"]
    assert r["cleanup"][0]["hard"] is False  # quarantine: cleanliness unproven, the device is not broken
    assert "No such file" not in r["cleanup"][0]["message"]
    assert r["validate_after"] == []


def test_restore_host_to_a_driver_without_an_id_table(lab: BootResult) -> None:
    """Defect: uio_pci_generic and pci-stub bind only by override; restore cleared it and left the device unbound."""
    r = lab.scenario("restore_host")
    for driver in ("uio_pci_generic", "pci-stub"):
        d = r[driver]
        assert (d["start_driver"], d["original_driver"], d["prepare"]) == (driver, driver, [])
        assert d["restore"] == [], d
        assert (d["driver_after"], d["driver_override_after"]) == (driver, driver)
    assert r["none"] == {"restore": [], "driver_after": None}
    assert r["back_to_vfio"] == "vfio-pci"


def test_prepare_without_an_iommu_names_the_missing_group(lab_image: LabImage, tmp_path: Path) -> None:
    """Defect: without an IOMMU vfio-pci's probe fails (-22) and prepare said only `bind_failed`, after it had
    already unbound the device and set driver_override. A second, short boot without `-device intel-iommu`."""
    run = boot(lab_image, tmp_path, ["prepare_no_iommu"], iommu=False)
    r = run.scenario("prepare_no_iommu")
    assert r["iommu_group"] is None and not r["groups_present"]
    assert "host.no_iommu" in r["readiness"]
    assert codes(r["problems"]) == ["backend.no_iommu_group"]
    assert "iommu_group" in r["problems"][0]["message"]
    assert (r["changed"], r["driver_after"], r["driver_override_after"]) == (False, None, None)  # nothing written
