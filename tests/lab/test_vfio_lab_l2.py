"""Opt-in slow check (CUBEACCEL_LAB_L2=1; not in default CI): a second-level guest uses the passed-through device.

L2 is the bare-metal tests/lab/l2/l2dma.c (built here with gcc -m32): DMA through L2 → L1's vfio-pci → QEMU's
emulated VT-d → edu, then it answers QMP `device_del`'s ACPI unplug request, so the device leaves the running VMM;
then the release rules' order (VMM exit, no holder, bus reset, validate). Cost: see docs/vfio.md.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.lab.harness import BootResult, LabParts, boot, build_lab_image

pytestmark = [
    pytest.mark.vm,
    pytest.mark.skipif(not os.environ.get("CUBEACCEL_LAB_L2"), reason="slow L2 check: set CUBEACCEL_LAB_L2=1"),
]
L2_DIR = Path(__file__).parent / "l2"


def build_l2(out: Path) -> Path:
    if shutil.which("gcc") is None or shutil.which("ld") is None:
        pytest.fail("CUBEACCEL_LAB_L2 is set but gcc/ld are missing (apt-get install gcc)")
    obj, elf = out / "l2dma.o", out / "l2dma.elf"
    flags = ["-m32", "-ffreestanding", "-nostdlib", "-fno-pic", "-fno-pie", "-fno-stack-protector", "-O2", "-Wall"]
    subprocess.run(["gcc", *flags, "-c", str(L2_DIR / "l2dma.c"), "-o", str(obj)], check=True)
    subprocess.run(["ld", "-m", "elf_i386", "-T", str(L2_DIR / "l2dma.ld"), "-o", str(elf), str(obj)], check=True)
    return elf


@pytest.fixture(scope="module")
def lab(lab_dir: Path, lab_base: LabParts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BootResult]:
    elf = build_l2(tmp_path_factory.mktemp("l2"))
    image = build_lab_image(lab_dir, with_qemu=True, parts=lab_base, extra={"/lab/l2dma.elf": elf}, name="l2")
    yield boot(
        image,
        tmp_path_factory.mktemp("lab-l2-boot"),
        ["prepare", "l2_dma_unplug"],
        memory_mib=1024,
        modules="scenarios,vmm_scenarios,l2_scenarios",
        total_timeout_s=1500,
        scenario_timeout_s=1200,
    )


def test_l2_does_dma_through_the_whole_chain_and_the_device_is_hot_unplugged(lab: BootResult) -> None:
    r = lab.scenario("l2_dma_unplug")
    print(
        f"L2: qmp {r['qmp_ready_s']} s, DMA done at {r['dma_s']} s, unplug {r['unplug_ms']} ms, total {r['total_s']} s"
    )
    console = r["console"]
    assert r["dma_done"], console + r["stderr"]
    assert "L2 LIVE OK" in console and "L2 DMA OK 00000000" in console, console
    assert r["holders_running"] and r["holders_running"][0]["command"] == "qemu-system-x86"
    assert r["device_del"] == {"return": {}}
    assert r["deleted"] is not None and r["deleted"]["data"]["device"] == "gpu0", r
    assert "L2 EJECTED" in console
    assert r["vmm_alive_after_unplug"]
    assert r["wait_released"] == [] and r["cleanup"] == [] and r["validate"] == []
