"""Every per-sandbox file dies with its run or is kept by the finished-runs rule (issue 30 #4): the run
directory, spec and shim log of a sandbox or scrub VM that is over leave `shims/`, and only the newest
`CUBEACCEL_KEEP_FINISHED_RUNS` finished runs are kept for post-mortems."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cubeaccel.cubelet.process_shim import ProcessShimDriver
from cubeaccel.cubelet.runfiles import FINISHED
from cubeaccel.cubelet.scrub import ProcessScrubRunner
from tests.host.test_scrub_vm_orphans import ATTACH, DEVICE, FAKE_SHIM
from tests.support.cubelet_harness import Node
from tests.support.poll import poll
from tests.support.scrub_stand_ins import image_present
from tests.support.vmm_cleanup import kill_started_vmms


def _run_files(root: Path, sid: str) -> None:
    (root / sid).mkdir()
    (root / sid / "console.log").write_bytes(b"x" * 100)
    (root / f"{sid}.json").write_text("{}")
    (root / f"{sid}.log").write_text("shim log\n")


def test_scrub_vms_leave_only_the_newest_finished_runs(
    node: Node, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUBEACCEL_KEEP_FINISHED_RUNS", "2")
    state = tmp_path / "state"
    fake = tmp_path / "fake-shim"
    fake.write_text(FAKE_SHIM.format(python=sys.executable, root=str(state / "shims")))
    fake.chmod(0o755)
    (state / "shims").mkdir(parents=True)
    (state / "shims" / "mode").write_text("die")
    runner = image_present(ProcessScrubRunner(state, image_digest="sha256:" + "a" * 64, python=str(fake)))
    try:
        for _ in range(4):
            assert not runner.run(node.device(DEVICE), ATTACH, 60.0).ok
    finally:
        kill_started_vmms(tmp_path)
    left = sorted(p.name for p in runner.dir.iterdir() if p.name.startswith("scrub-"))
    assert left == [], f"scrub VMs' files pile up: {left}"
    finished = sorted((runner.dir / FINISHED).iterdir())
    assert len(finished) == 2
    assert {p.name for p in finished[-1].iterdir()} >= {"spec.json", "shim.log", "vmm.pid"}


def test_a_sandbox_run_is_retired_only_when_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUBEACCEL_KEEP_FINISHED_RUNS", "1")
    driver = ProcessShimDriver(tmp_path / "state", launch="spawn")
    root = driver.dir
    for sid in ("old-1", "old-2", "open-1", "busy-1"):
        _run_files(root, sid)
    (root / "forkserver.log").write_text("the fork server's own log\n")
    (root / "template-prepare.log").write_text("not a run either\n")
    # busy-1's shim still runs (it has no reservation any more: it is finishing)
    argv = [sys.executable, "-c", "import time; time.sleep(600)", "-m", "cubeaccel.shim", "run"]
    shim = subprocess.Popen([*argv, "--sandbox", "busy-1", "--spec", str(root / "busy-1.json")])
    try:
        poll(lambda: ((root / "busy-1.json").exists() and driver.status("busy-1").shim_alive) or None, 10.0)
        assert sorted(driver.retire_runs(lambda: {"open-1"})) == ["old-1", "old-2"]
    finally:
        shim.kill()
        shim.wait()
    names = {p.name for p in root.iterdir()}
    assert {"open-1", "open-1.json", "open-1.log", "busy-1", "busy-1.json"} <= names
    assert {"forkserver.log", "template-prepare.log"} <= names
    assert not names & {"old-1", "old-1.json", "old-1.log", "old-2", "old-2.json", "old-2.log"}
    kept = list((root / FINISHED).iterdir())
    assert len(kept) == 1 and kept[0].name.endswith("-old-2")  # the newest one
    assert (kept[0] / "console.log").read_bytes() == b"x" * 100
    assert driver.retire_runs(lambda: {"open-1"}) == ["busy-1"]  # its shim is gone now
