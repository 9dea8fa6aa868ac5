"""`cubeaccel host check`: each prerequisite as pass/fail with a reason, on fake trees and on this machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from cubeaccel.cli import app
from cubeaccel.host.pci.readiness import Status, check_host
from tests.support.fake_sysfs import Dev, FakeSysfs


def _status(fake: FakeSysfs) -> dict[str, tuple[Status, str]]:
    result = check_host(fake.sys, fake.dev, fake.proc)
    return {c.name: (c.status, c.code) for c in result.checks}


def test_a_kvm_host_with_iommu_and_vfio_is_ready(tmp_path: Path) -> None:
    fake = FakeSysfs.build(tmp_path, [Dev("0000:3b:00.0", iommu_group=12)])
    result = check_host(fake.sys, fake.dev, fake.proc)
    assert result.ready, result.to_json()
    assert all(c.status == Status.PASS for c in result.checks)
    assert result.facts["iommu_cmdline"] == ["intel_iommu=on", "iommu=pt"]


def test_no_iommu_fails_plainly(tmp_path: Path) -> None:
    fake = FakeSysfs.build(tmp_path, [Dev("0000:3b:00.0")], iommu=False)
    result = check_host(fake.sys, fake.dev, fake.proc)
    assert not result.ready
    iommu = next(c for c in result.checks if c.name == "iommu")
    assert (iommu.status, iommu.code) == (Status.FAIL, "host.no_iommu")
    assert "no IOMMU" in iommu.reason and "intel_iommu=on" in iommu.reason


def test_pvm_host_cannot_pass_devices_through(tmp_path: Path) -> None:
    fake = FakeSysfs.build(tmp_path, [], modules=("kvm", "kvm_pvm", "vfio_pci"))
    assert _status(fake)["virtualization"] == (Status.FAIL, "host.pvm_unsupported")


def test_pvm_is_seen_in_proc_modules_too(tmp_path: Path) -> None:
    fake = FakeSysfs.build(tmp_path, [], modules=("kvm_intel",))
    (fake.proc / "modules").write_text("kvm_pvm 90112 0 - Live 0x0\n")
    assert _status(fake)["virtualization"] == (Status.FAIL, "host.pvm_unsupported")


def test_missing_vfio_pieces_each_have_their_code(tmp_path: Path) -> None:
    fake = FakeSysfs.build(tmp_path, [], drivers=("nvidia",), dev_files=("kvm",), modules=("kvm_amd",))
    status = _status(fake)
    assert status["vfio_pci"] == (Status.FAIL, "host.vfio_pci_unavailable")
    assert status["vfio_container"] == (Status.FAIL, "host.no_vfio_device")
    assert status["iommufd"] == (Status.WARN, "")
    assert status["virtualization"] == (Status.PASS, "")


def test_interrupt_remapping_missing_or_overridden_fails(tmp_path: Path) -> None:
    fake = FakeSysfs.build(tmp_path / "a", [], ecap=0xF020D7)  # bit 3 clear
    assert _status(fake)["interrupt_remapping"] == (Status.FAIL, "host.no_interrupt_remapping")
    fake = FakeSysfs.build(tmp_path / "b", [])
    (fake.sys / "module/vfio_iommu_type1/parameters/allow_unsafe_interrupts").write_text("Y\n")
    assert _status(fake)["interrupt_remapping"] == (Status.FAIL, "host.unsafe_interrupts")


def test_cli_check_on_a_ready_fake_host_exits_zero(tmp_path: Path) -> None:
    fake = FakeSysfs.build(tmp_path, [Dev("0000:3b:00.0", iommu_group=12)])
    args = ["host", "check", "--sysfs-root", str(fake.sys), "--dev-root", str(fake.dev), "--proc-root", str(fake.proc)]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["ready"] is True
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0 and "ready" in result.output


def test_cli_check_on_this_machine_says_why_and_exits_non_zero() -> None:
    """This dev machine is a nested PVM guest with no IOMMU: the real command must say so, not crash."""
    proc = subprocess.run(
        [sys.executable, "-c", "from cubeaccel.cli import main; main()", "host", "check", "--json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    assert report["ready"] is False
    by_name = {c["name"]: c for c in report["checks"]}
    has_groups = any(Path("/sys/kernel/iommu_groups").iterdir())
    assert (by_name["iommu"]["status"] == "pass") == has_groups
    if Path("/sys/module/kvm_pvm").exists():
        assert by_name["virtualization"]["code"] == "host.pvm_unsupported"
