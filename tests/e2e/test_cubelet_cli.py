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
    assert "0000:10:00.0" in out.stdout and "H100-PCIe-80GB" in out.stdout and "allocatable" in out.stdout
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
    dev = cubelet.client.devices()[0].id
    out = _cli(cubelet, "device", "enable", dev, "--who", "a", "--reason", "b")
    assert out.returncode == 1 and "state.transition_refused" in out.stderr


def test_a_device_is_named_by_its_full_id_or_its_address(cubelet: CubeletProcess) -> None:
    dev = cubelet.client.devices()[1]
    out = _cli(cubelet, "-o", "json", "device", "quarantine", dev.address, "--who", "a", "--reason", "b")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["id"] == dev.id and json.loads(out.stdout)["state"] == "quarantined"


def test_events_follow_prints_new_matching_events_as_they_happen(cubelet: CubeletProcess) -> None:
    x, y = (d.id for d in cubelet.client.devices()[2:4])
    cmd = [sys.executable, "-m", "cubeaccel", "events", "--follow", "--device", x, "--limit", "1", "-o", "json"]
    follow = subprocess.Popen(
        [*cmd, "--state-dir", str(cubelet.state_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert follow.stdout is not None
        first = json.loads(follow.stdout.readline())  # the newest existing event of x, then the new ones
        assert first["device_id"] == x
        cubelet.client.verb(y, "quarantine", "carol", "not followed")
        cubelet.client.verb(x, "quarantine", "carol", "followed")
        new = json.loads(follow.stdout.readline())  # y's event is filtered out: the next line is x's
        assert new["device_id"] == x and new["details"]["why"] == "followed" and new["seq"] > first["seq"]
    finally:
        follow.terminate()
        follow.wait(timeout=10)
