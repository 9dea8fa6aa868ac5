"""A VMM that really holds the device inside the lab guest, and the Cubelet's release rules around it.

QEMU (the host's, copied into the guest) runs paused (`-S`): it opens the device through VFIO at startup or on QMP
`device_add`, pins the guest's RAM for DMA, and the L2 guest never runs. One boot runs every scenario of
tests/lab/guest/vmm_scenarios.py and cubelet_scenarios.py.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from typing import Any

import pytest

from tests.lab.harness import BootResult, LabImage, boot

pytestmark = pytest.mark.vm

RP = "0000:01:00.0"
GUEST_KIB = 64 * 1024
PLAN = ["prepare", "vmm_paused", "vmm_hotplug", "vmm_group_not_viable", "cubelet_cycle", "vmm_cycles"]


@pytest.fixture(scope="module")
def lab(lab_vmm_image: LabImage, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BootResult]:
    yield boot(
        lab_vmm_image,
        tmp_path_factory.mktemp("lab-vmm-boot"),
        PLAN,
        memory_mib=768,
        modules="scenarios,vmm_scenarios,cubelet_scenarios",
    )


def codes(problems: list[dict[str, Any]]) -> list[str]:
    return [p["code"] for p in problems]


def _released(rel: dict[str, Any]) -> None:
    assert codes(rel["while_alive"]) == ["host.device_held"]  # never released while the VMM lives
    assert rel["rc"] == 0
    assert rel["wait_released"] == [] and rel["holders_after"] == []
    assert rel["cleanup"] == [] and rel["validate"] == []  # bus reset, same identity, back in service


def test_a_paused_qemu_with_the_device_is_its_holder_and_pins_guest_ram(lab: BootResult) -> None:
    r = lab.scenario("vmm_paused")
    assert r["status"]["return"]["status"] == "prelaunch"
    assert [(h["pid"], h["command"], h["unknown"]) for h in r["holders"]] == [(r["vmm_pid"], "qemu-system-x86", False)]
    # VFIO's type1 container pins the whole guest RAM: VmLck on 6.1, not VmPin (docs/shim.md)
    assert r["memory"]["VmLck"] >= GUEST_KIB * 0.95 and r["memory"]["VmPin"] == 0, r["memory"]
    assert codes(r["validate"]) == ["host.device_held"]
    assert r["health_attached"] == [] and codes(r["health_allocatable"]) == ["host.unexpected_holder"]
    _released(r["release"])


def test_a_second_vmm_cannot_open_a_held_device(lab: BootResult) -> None:
    r = lab.scenario("vmm_paused")
    second = r["second_vmm"]
    assert second["rc"] != 0 and "Device or resource busy" in second["stderr"], second
    assert [h["pid"] for h in r["holders_after_refusal"]] == [r["vmm_pid"]]  # the first keeps it


def test_hot_plug_over_qmp_makes_the_vmm_a_holder(lab: BootResult) -> None:
    r = lab.scenario("vmm_hotplug")
    assert r["holders_before"] == []
    assert r["device_add"] == {"return": {}}
    assert [h["pid"] for h in r["holders"]] == [r["vmm_pid"]] and r["enable"] == 1
    assert r["memory"]["VmLck"] >= GUEST_KIB * 0.95
    _released(r["release"])


def test_qemu_and_cubeaccel_agree_a_split_group_is_not_viable(lab: BootResult) -> None:
    r = lab.scenario("vmm_group_not_viable")
    assert codes(r["validate"]) == ["backend.iommu_group_not_viable"]
    assert r["vmm"]["rc"] != 0 and f"group {r['group']} is not viable" in r["vmm"]["stderr"]


def test_the_cubelet_keeps_a_device_out_of_service_until_every_holder_is_gone(lab: BootResult) -> None:
    """reserve → start (QEMU hot-plugs over QMP) → attached → release: waits while QEMU lives, and after it exited
    while a straggler keeps only the device fd (was: reset and handed back with `holders: 0`)."""
    r = lab.scenario("cubelet_cycle")
    assert r["initial"] == "allocatable" and r["attached"] == "attached"
    assert [h["pid"] for h in r["holders_attached"]] == [r["vmm_pid"]]
    assert r["repairs"] == [] and r["after_reconcile"] == "attached"
    assert r["releasing_vmm_alive"] == "releasing"
    assert r["reserve_while_releasing"] == "reserve.insufficient_devices"
    assert "Device or resource busy" in r["second_vmm"]["stderr"]
    assert r["releasing_straggler"] == "releasing"
    assert r["waits"] == ["release.vmm_not_exited", "release.holder_stuck"]
    assert r["released"] == "allocatable" and r["reservation_closed"]
    want = {
        "vmm_exited": True,
        "shim_exited": True,
        "shim_final_report": False,
        "detach_confirmed": False,
        "holders": 0,
        "reset": True,
        "scrub_owed": True,  # then the (stood-in) scrub VM and a second reset, before `allocatable`
        "scrub_policy": "trusted-vm",
        "vmm_started": True,
    }
    assert {k: r["evidence"].get(k) for k in want} == want, r["evidence"]


def test_vmm_lab_boot_time(lab: BootResult) -> None:
    elapsed = {name: r.get("elapsed_s") for name, r in lab.results.items()}
    print(f"vmm lab boot: ready {lab.ready_s:.1f} s, done {lab.total_s:.1f} s, attempts {lab.attempts}; {elapsed}")
    assert lab.attempts <= 2 and lab.total_s < 150


def test_open_release_reset_validate_cycles(lab: BootResult) -> None:
    cycles = lab.scenario("vmm_cycles")["cycles"]
    assert len(cycles) == 3 and all(c["holder_seen"] and c["ok"] for c in cycles), cycles
    ms = sorted(c["cycle_ms"] for c in cycles)
    print(f"vmm cycle ms min/median/max {ms[0]}/{statistics.median(ms)}/{ms[-1]}")
    assert ms[-1] < 30_000
