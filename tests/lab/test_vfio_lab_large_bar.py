"""A GPU-sized BAR through the real kernel's VFIO: a 64 GiB 64-bit prefetchable BAR (QEMU's pci-testdev, no RAM
behind it) on the lab guest's machine, bound to vfio-pci there and hot-plugged into the lab's own QEMU, which sees
the BAR at its full size; then the release rules' order (VMM exit, no holder, bus reset, validate).

The lab guest's q35 gets a 64-bit PCI hole and a root-port window big enough for it, and the address bits to
reach them (tests/lab/guest/bar_scenarios.py says how the inner QEMU is run).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.lab.harness import BootResult, LabImage, boot

pytestmark = pytest.mark.vm

GIB = 1 << 30
BAR_GIB = 64
LARGE_BAR = (
    "-cpu", "max,phys-bits=46",
    "-global", "q35-pcihost.pci-hole64-size=256G",
    "-device", f"pcie-root-port,id=rp9,chassis=9,slot=9,addr=06.0,pref64-reserve={2 * BAR_GIB}G",
    "-device", f"pci-testdev,membar={BAR_GIB}G,bus=rp9",
)  # fmt: skip
PREFETCH_64 = 0x2000 | 0x4 | 0x8  # IORESOURCE_MEM, 64-bit, prefetchable (sysfs `resource` flags)


@pytest.fixture(scope="module")
def lab(lab_vmm_image: LabImage, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BootResult]:
    yield boot(
        lab_vmm_image,
        tmp_path_factory.mktemp("lab-large-bar"),
        ["vfio_large_bar"],
        memory_mib=768,
        modules="scenarios,vmm_scenarios,bar_scenarios",
        scenario_timeout_s=180,
        total_timeout_s=300,
        extra_args=LARGE_BAR,
    )


def test_a_64_gib_bar_bound_to_vfio_pci_is_hot_plugged_and_the_vmm_sees_it_whole(lab: BootResult) -> None:
    r = lab.scenario("vfio_large_bar")
    l1 = r["l1_resource"]
    assert l1["size"] == BAR_GIB * GIB and l1["flags"] & PREFETCH_64 == PREFETCH_64, l1  # the lab kernel placed it
    assert r["driver"] == "vfio-pci" and r["validate_before"] == []
    assert r["device_add"] == {"return": {}}
    assert [h["pid"] for h in r["holders"]] == [r["vmm_pid"]]
    [dev] = r["query_pci"]
    bars = {b["bar"]: b for b in dev["regions"]}
    assert bars[2]["size"] == BAR_GIB * GIB, bars  # QEMU sized it from VFIO's region info: the whole 64 GiB
    assert bars[2]["prefetch"] is True and bars[2]["mem_type_64"] is True
    rel = r["release"]
    assert [p["code"] for p in rel["while_alive"]] == ["host.device_held"]
    assert rel["wait_released"] == [] and rel["holders_after"] == [] and rel["cleanup"] == [] and rel["validate"] == []
    took = f"firmware {r['firmware_ms']} ms, device_add {r['device_add_ms']} ms, total {lab.total_s:.1f} s"
    print(f"large BAR lab: {took}")
