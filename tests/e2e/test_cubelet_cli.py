"""The operator CLI against a real Cubelet process."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.cubelet_process import CubeletProcess


def _cli(p: CubeletProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cubeaccel", *args, "--state-dir", str(p.state_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_devices_table_a_quarantine_and_its_event(cubelet: CubeletProcess) -> None:
    out = _cli(cubelet, "devices")
    assert out.returncode == 0
    assert "0000:10:00.0" in out.stdout and "H100-SXM5-80GB" in out.stdout and "allocatable" in out.stdout
    dev = json.loads(_cli(cubelet, "devices", "--json").stdout)["devices"][0]["id"]
    q = _cli(cubelet, "device", "quarantine", dev, "--who", "alice", "--reason", "ECC")
    assert q.returncode == 0 and "quarantined" in q.stdout
    ev = json.loads(_cli(cubelet, "events", "--json").stdout)["events"]  # newest first
    assert ev[0]["details"]["who"] == "alice" and ev[0]["to_state"] == "quarantined"
    table = _cli(cubelet, "events", "--device", dev, "--event", "quarantine")
    assert "operator:alice" in table.stdout and "ECC" in table.stdout  # who and why, for an operator's action


def test_cli_errors_print_their_code_and_exit_1(cubelet: CubeletProcess) -> None:
    out = _cli(cubelet, "device", "recover", "no-such-device", "--who", "a", "--reason", "b")
    assert out.returncode == 1
    assert "device.not_found" in out.stderr and out.stdout == ""  # errors on stderr
    dev = cubelet.client.devices()[0]["id"]
    out = _cli(cubelet, "device", "enable", dev, "--who", "a", "--reason", "b")
    assert out.returncode == 1 and "state.transition_refused" in out.stderr
