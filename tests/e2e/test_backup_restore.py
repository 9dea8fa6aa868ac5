"""Backup while running, restore into a fresh state dir: the stack comes up with the same devices and sandboxes.

The backups are taken with the CLI while `cubeaccel up`'s CubeMaster and Cubelet serve (SQLite's online backup);
a change made after the backup is absent from the restored stack, so the snapshot is the backup's, not a later copy.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from cubeaccel.master.up import run_down, run_up
from cubeaccel.transport.cubelet_client import CubeletClient
from cubeaccel.transport.master_client import MasterClient
from tests.support.cubelet_process import CubeletProcess


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cubeaccel", *args], capture_output=True, text=True, timeout=60, check=False
    )


def _devices(state: Path) -> list[tuple[str, str, str | None, str | None]]:
    c = CubeletClient(socket=state / "cubelet" / "cubelet.sock")
    try:
        return [(d.id, d.state, d.sandbox_id, d.reason) for d in c.devices()]
    finally:
        c.close()


def test_a_restored_stack_has_the_same_devices_and_sandboxes(tmp_path: Path) -> None:
    old, new, bak = tmp_path / "old", tmp_path / "new", tmp_path / "backup"
    assert run_up(old, "simulated", "h100x4", detach=True) == 0
    try:
        info = json.loads((old / "up.json").read_text())
        m = MasterClient(info["master_url"], key=(old / "default.key").read_text().strip())
        sandbox = m.create({"gpu": "H100:1"})
        m.close()
        assert sandbox.state == "running"
        idle = next(d for d, state, _, _ in _devices(old) if state == "allocatable")
        q = cli("device", "quarantine", idle, "--who", "alice", "--reason", "ECC", "--state-dir", str(old / "cubelet"))
        assert q.returncode == 0, q.stderr
        assert cli("master", "backup", str(bak / "master"), "--state-dir", str(old)).returncode == 0
        assert cli("cubelet", "backup", str(bak / "cubelet"), "--state-dir", str(old / "cubelet")).returncode == 0
        backed_up = _devices(old)
        later = next(d for d, state, _, _ in backed_up if state == "allocatable")
        after = cli(
            "device", "disable", later, "--who", "bob", "--reason", "after", "--state-dir", str(old / "cubelet")
        )
        assert after.returncode == 0  # not in the backup
    finally:
        run_down(old)

    assert cli("master", "restore", str(bak / "master"), "--state-dir", str(new)).returncode == 0
    assert cli("cubelet", "restore", str(bak / "cubelet"), "--state-dir", str(new / "cubelet")).returncode == 0
    for key in ("admin.key", "default.key"):  # secrets stay with the operator: the database holds their hashes
        shutil.copy2(old / key, new / key)
    assert run_up(new, "simulated", "h100x4", detach=True) == 0
    try:
        info = json.loads((new / "up.json").read_text())
        m = MasterClient(info["master_url"], key=(new / "default.key").read_text().strip())  # the old key works
        rows = {s.id: s for s in m.sandboxes()}
        m.close()
        assert rows[sandbox.id].state == "running" and rows[sandbox.id].device_ids == sandbox.device_ids
        assert _devices(new) == backed_up  # same ids, states, holders and reasons; the later disable is absent
        assert (idle, "quarantined", None, "operator.quarantine") in backed_up
    finally:
        run_down(new)


def test_restore_refuses_a_used_state_dir_and_a_running_server(tmp_path: Path) -> None:
    (tmp_path / "live").mkdir()
    p = CubeletProcess(tmp_path / "live").start()
    try:
        out = cli("cubelet", "backup", str(tmp_path / "b"), "--state-dir", str(p.state_dir))
        assert out.returncode == 0, out.stderr
        busy = cli("cubelet", "restore", str(tmp_path / "b"), "--state-dir", str(p.state_dir))
        assert busy.returncode == 1 and "state.locked" in busy.stderr  # a Cubelet runs there
        again = cli("-o", "json", "cubelet", "backup", str(tmp_path / "b"), "--state-dir", str(p.state_dir))
        assert json.loads(again.stdout)["error"]["code"] == "backup.failed"  # never over an earlier backup
    finally:
        p.stop()
    used = cli("cubelet", "restore", str(tmp_path / "b"), "--state-dir", str(p.state_dir))
    assert used.returncode == 1 and "backup.failed" in used.stderr and "fresh state directory" in used.stderr
    wrong = cli("master", "restore", str(tmp_path / "b"), "--state-dir", str(tmp_path / "m"))
    assert wrong.returncode == 1 and "not a master one" in wrong.stderr
    pg = cli("master", "backup", str(tmp_path / "pg"), "--db", "postgresql://u@db/x")
    assert pg.returncode == 1 and "pg_dump" in pg.stderr
