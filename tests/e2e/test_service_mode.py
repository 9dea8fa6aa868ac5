"""Service mode: one process per state dir (an flock naming its holder), and an `up` that starts nothing twice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cubeaccel.host.service.statelock import LOCKED_EXIT
from cubeaccel.master.up import run_down, run_up
from tests.support.cubelet_process import CubeletProcess
from tests.support.master_harness import MasterProcess, free_port


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cubeaccel", *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_a_second_cubelet_on_a_held_state_dir_exits_with_the_locks_code(tmp_path: Path) -> None:
    first = CubeletProcess(tmp_path).start()
    try:
        assert first.proc is not None
        second = _serve("cubelet", "serve", "--backend", "simulated", "--state-dir", str(tmp_path))
        assert second.returncode == LOCKED_EXIT, second
        [line] = second.stderr.strip().splitlines()  # one line, no traceback
        assert "state.locked" in line and f"pid {first.proc.pid}" in line and str(tmp_path) in line
        assert second.stdout == ""
        assert len(first.client.devices()) == 8  # the first one still serves, its store untouched
    finally:
        first.stop()
    again = CubeletProcess(tmp_path).start()  # the kernel dropped the lock with its holder: a restart takes it
    again.stop()


def test_a_second_cubemaster_on_a_held_state_dir_exits_with_the_locks_code(tmp_path: Path) -> None:
    first = MasterProcess(tmp_path).start()
    try:
        assert first.proc is not None
        second = _serve(
            "-o", "json", "master", "serve", "--state-dir", str(tmp_path), "--listen", f"127.0.0.1:{free_port()}"
        )
        assert second.returncode == LOCKED_EXIT
        err = json.loads(second.stdout)["error"]  # under -o json the refusal is one JSON document
        assert err["code"] == "state.locked" and err["details"]["holder_pid"] == first.proc.pid
        assert first.client.health().status == "ok"
    finally:
        first.stop()


def _ready_lines(log: Path) -> int:
    return sum(1 for line in log.read_text().splitlines() if '"cubemaster": "ready"' in line)


def test_a_second_up_reports_the_running_stack_and_starts_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_up(tmp_path, "simulated", "h100x2", detach=True) == 0
    try:
        info = json.loads((tmp_path / "up.json").read_text())
        capsys.readouterr()
        assert run_up(tmp_path, "simulated", "h100x2", detach=True) == 0
        out = capsys.readouterr().out
        assert "already running" in out and info["master_url"] in out
        assert json.loads((tmp_path / "up.json").read_text()) == info  # the same pair, not a new one
        assert _ready_lines(tmp_path / "master.log") == 1
        for pid in info["pids"]:
            os.kill(pid, 0)  # the first pair still runs (not orphaned, not replaced)
    finally:
        assert run_down(tmp_path) == 0


def test_two_ups_racing_on_one_dir_start_one_pair(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "cubeaccel", "up", "--detach", "--backend", "simulated", "--state-dir", str(tmp_path)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs
        assert sum("already running" in o for o, _ in outs) == 1, outs
        assert _ready_lines(tmp_path / "master.log") == 1
    finally:
        assert run_down(tmp_path) == 0


def test_up_after_its_stack_died_starts_a_fresh_one(tmp_path: Path) -> None:
    import signal

    assert run_up(tmp_path, "simulated", "h100x2", detach=True) == 0
    dead = json.loads((tmp_path / "up.json").read_text())
    for pid in dead["pids"]:
        os.kill(pid, signal.SIGKILL)
    try:
        assert run_up(tmp_path, "simulated", "h100x2", detach=True) == 0
        fresh = json.loads((tmp_path / "up.json").read_text())
        assert set(fresh["pids"]).isdisjoint(dead["pids"])
    finally:
        assert run_down(tmp_path) == 0
