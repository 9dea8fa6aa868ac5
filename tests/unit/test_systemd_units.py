"""The systemd units in deploy/systemd: notify-type, restarted on failure, memlock limits, and each one's
ExecStart a command this CLI has; `systemd-analyze verify` accepts them where systemd is installed."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

UNITS = Path(__file__).resolve().parents[2] / "deploy" / "systemd"
NAMES = ("cubeaccel-master.service", "cubeaccel-cubelet.service", "cubeaccel-api.service")


def parse(path: Path) -> dict[str, dict[str, str]]:
    sections: dict[str, dict[str, str]] = {}
    current: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
        else:
            k, _, v = line.partition("=")
            current[k] = v
    return sections


@pytest.mark.parametrize("name", NAMES)
def test_unit_is_a_restarting_notify_service_with_a_memlock_limit(name: str) -> None:
    svc = parse(UNITS / name)["Service"]
    assert svc["Type"] == "notify" and svc["NotifyAccess"] == "main"
    assert svc["Restart"] == "on-failure"
    assert "LimitMEMLOCK" in svc
    argv = svc["ExecStart"].split()
    assert argv[0].endswith("/cubeaccel") and argv[2] == "serve"
    if name == "cubeaccel-cubelet.service":
        assert svc["LimitMEMLOCK"] == "infinity"  # the VMMs it starts pin all guest memory
        assert svc["KillMode"] == "process"  # sandboxes outlive a Cubelet restart


@pytest.mark.parametrize("name", [n for n in NAMES if n != "cubeaccel-api.service"])
def test_exec_start_names_a_command_this_cli_has(name: str) -> None:
    argv = parse(UNITS / name)["Service"]["ExecStart"].split()
    out = subprocess.run(
        [sys.executable, "-m", "cubeaccel", *argv[1:], "--help"], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verify_accepts_the_units(tmp_path: Path) -> None:
    exe = shutil.which("cubeaccel") or str(Path(sys.executable).parent / "cubeaccel")
    for name in NAMES:  # verify checks ExecStart is executable: point it at this environment's entry point
        (tmp_path / name).write_text((UNITS / name).read_text().replace("/usr/local/bin/cubeaccel", exe))
    out = subprocess.run(
        ["systemd-analyze", "verify", *(str(tmp_path / n) for n in NAMES)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr
    ours = [line for line in out.stderr.splitlines() if str(tmp_path) in line]
    assert ours == []  # no unknown key, no bad value in our files (verify only warns for those)
