"""scripts/gpu-discover.py: the read-only discovery the lead runs on a real GPU host."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support.fake_sysfs import Dev, FakeSysfs
from tests.support.holder_proc import unreadable_pids

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu-discover.py"


def test_discovers_a_fake_h200_host_without_writing(tmp_path: Path) -> None:
    fake = FakeSysfs.build(
        tmp_path,
        [Dev("0000:18:00.0", device=0x2335, iommu_group=5, numa_node=0, serial=0x42),
         Dev("0000:18:00.1", device=0x22A3, class_code=0x040300, iommu_group=5, driver="snd_hda_intel")],
    )  # fmt: skip
    before = sorted((p.relative_to(fake.sys).as_posix(), p.read_bytes()) for p in fake.sys.rglob("*") if p.is_file())
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--sysfs-root",
            str(fake.sys),
            *(f"--holder-scan-exempt-pid={pid}" for pid in unreadable_pids()),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["read_only"] is True
    (gpu,) = report["accelerators"]
    assert (gpu["address"], gpu["labels"]["model"], gpu["iommu_group"]) == ("0000:18:00.0", "H200-SXM-141GB", 5)
    assert gpu["reset_method"] == ["flr", "bus"] and gpu["driver"] == "nvidia"
    assert gpu["group_offenders"] == ["0000:18:00.1(snd_hda_intel)"]
    codes = [p["code"] for p in gpu["validate_if_selected"]]
    assert codes == ["backend.wrong_driver", "backend.iommu_group_not_viable"]
    assert [m["address"] for m in report["iommu_groups"]["5"]] == ["0000:18:00.0", "0000:18:00.1"]
    assert len(report["functions"]) == 2
    after = sorted((p.relative_to(fake.sys).as_posix(), p.read_bytes()) for p in fake.sys.rglob("*") if p.is_file())
    assert after == before


def test_the_audit_hook_refuses_writes_under_proc_sys_and_dev() -> None:
    code = "\n".join(
        [
            "import os, runpy, sys",
            f"runpy.run_path({str(SCRIPT)!r}, run_name='imported')",
            "for attempt in (lambda: open('/proc/self/comm', 'w'), lambda: os.open('/proc/self/comm', os.O_WRONLY)):",
            "    try:",
            "        attempt()",
            "    except PermissionError as e:",
            "        print('refused', 'read-only' in str(e))",
            "print(open('/proc/self/comm').read().strip() != '')",
        ]
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split("\n")[:3] == ["refused True", "refused True", "True"], proc.stderr
