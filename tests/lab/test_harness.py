"""The lab harness's own rules, with a stand-in QEMU on PATH (no VM): one retry for a boot that never reaches the
runner, bounded waits, results parsed from the console even with kernel noise between the lines."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from tests.lab.harness import MAX_LOAD_SCALE, LabError, LabImage, boot

# Argv as harness._qemu_cmd builds it; behaviour per attempt from MODE (one word per attempt, in a file).
FAKE_QEMU = """#!{python}
import json, sys, time
from pathlib import Path
argv = sys.argv
log = Path(argv[argv.index("-serial") + 1][len("file:"):])
plan = [w for w in argv[argv.index("-append") + 1].split() if w.startswith("lab.plan=")][0][9:].split(",")
state = Path({state!r})
modes = state.read_text().split()
attempt = len(list(state.parent.glob("attempt-*")))
(state.parent / f"attempt-{{attempt}}").write_text("")
mode = modes[min(attempt, len(modes) - 1)]
if mode == "silent":
    sys.exit(0)
with log.open("w") as f:
    f.write("[    1.0] random kernel noise\\nLAB " + json.dumps({{"ready": True}}) + "\\n")
    f.flush()
    for name in plan:
        f.write("DMAR: noise LAB " + json.dumps({{"scenario": name, "ok": True, "result": {{"n": name}}}}) + "\\n")
        f.flush()
        if mode == "hang":
            time.sleep(60)
    f.write("LAB " + json.dumps({{"done": True}}) + "\\n")
time.sleep(60 if mode == "linger" else 0)
"""


def _fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, modes: str) -> LabImage:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    state = tmp_path / "state" / "modes"
    state.parent.mkdir()
    state.write_text(modes)
    qemu = bin_dir / "qemu-system-x86_64"
    qemu.write_text(FAKE_QEMU.format(python=sys.executable, state=str(state)))
    qemu.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    return LabImage(tmp_path / "vmlinux", tmp_path / "initrd", "6.1.0-test", 0.0, 0)


def attempts(tmp_path: Path) -> int:
    return len(list((tmp_path / "state").glob("attempt-*")))


def test_a_boot_that_never_reaches_the_runner_is_retried_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    image = _fake(tmp_path, monkeypatch, "silent ok")
    r = boot(image, tmp_path, ["a", "b"], ready_timeout_s=5)
    assert r.attempts == 2 == attempts(tmp_path)
    assert r.scenario("a") == {"n": "a"} and r.scenario("b") == {"n": "b"}  # noise before "LAB " is ignored


def test_two_silent_boots_fail_with_the_console(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    image = _fake(tmp_path, monkeypatch, "silent")
    with pytest.raises(LabError, match="never reached its runner"):
        boot(image, tmp_path, ["a"], ready_timeout_s=5)
    assert attempts(tmp_path) == 2


def test_a_run_that_hangs_is_cut_at_the_deadline_and_names_what_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    image = _fake(tmp_path, monkeypatch, "hang")
    t0 = time.monotonic()
    with pytest.raises(LabError, match=r"no result for \['b'\]"):
        boot(image, tmp_path, ["a", "b"], ready_timeout_s=5, total_timeout_s=3)
    assert time.monotonic() - t0 < 5 + 3 * MAX_LOAD_SCALE and attempts(tmp_path) == 1  # a boot that ran is not retried


def test_done_ends_the_wait_even_if_the_vmm_lingers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    image = _fake(tmp_path, monkeypatch, "linger")
    t0 = time.monotonic()
    r = boot(image, tmp_path, ["a"], ready_timeout_s=5)
    assert time.monotonic() - t0 < 15 and r.attempts == 1
    assert json.dumps(r.scenario("a")) == '{"n": "a"}'


def test_a_scenario_that_raised_fails_with_its_traceback(tmp_path: Path) -> None:
    from tests.lab.harness import BootResult

    r = BootResult({"x": {"scenario": "x", "ok": False, "error": "Traceback: boom"}}, 1.0, 2.0, 1, "")
    with pytest.raises(LabError, match="boom"):
        r.scenario("x")
    with pytest.raises(LabError, match="no result"):
        r.scenario("y")


def test_the_allowances_stretch_with_the_load_per_core_within_a_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.lab import harness

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    for load, scale in ((0.5, 1.0), (4.0, 2.0), (18.0, MAX_LOAD_SCALE)):
        monkeypatch.setattr(os, "getloadavg", lambda load=load: (load, 0.0, 0.0))
        assert harness.load_scale() == scale
