"""A scrub VM's processes are ended on every exit path and found again after a restart (issue 30 #5).

The runner is the real `ProcessScrubRunner`; the shim it starts is a stand-in at its process boundary (`python`
is a script): it starts a tagged "VMM" in its own session, writes `vmm.pid` as the real shim does, and then either
dies at once (a shim killed after its QEMU started) or hangs (a scrub in flight when the Cubelet died).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cubeaccel.backends.base import AttachSpec
from cubeaccel.cubelet.scrub import ProcessScrubRunner
from cubeaccel.host.vmm.vmmproc import find_shim, inspect
from tests.support.cubelet_harness import Node
from tests.support.poll import poll
from tests.support.scrub_stand_ins import image_present
from tests.support.vmm_cleanup import kill_started_vmms, started_vmms

DEVICE = "vfio-0000:10:00.0"
ATTACH = AttachSpec("vfio-pci", {"host": "0000:10:00.0"})
FAKE_SHIM = """#!{python}
import json, os, subprocess, sys, time
from pathlib import Path
from cubeaccel.host.vmm.vmmproc import vmm_processes
args = sys.argv[1:]
sid = args[args.index("--sandbox") + 1]
spec = json.loads(Path(args[args.index("--spec") + 1]).read_text())
state = Path(spec["state_dir"])
state.mkdir(parents=True, exist_ok=True)
root = Path({root!r})
others = [p.pid for p in vmm_processes() if p.under(root) and p.sandbox_id != sid]
(root / f"seen-{{sid}}.json").write_text(json.dumps(others))
vmm = subprocess.Popen(
    [sys.executable, "-c", "import time; time.sleep(600)", "guest=cubeaccel-sandbox=" + sid, str(state / "qmp.sock")],
    env={{"CUBEACCEL_SANDBOX": sid, "CUBEACCEL_DEVICES": spec["devices"][0]["device_id"]}},
    start_new_session=True,
)
(state / "vmm.pid").write_text(f"{{vmm.pid}}\\n")
if (root / "mode").read_text().strip() == "hang":
    time.sleep(600)
sys.exit(1)
"""


@pytest.fixture
def runner(tmp_path: Path) -> Iterator[ProcessScrubRunner]:
    state = tmp_path / "state"
    fake = tmp_path / "fake-shim"
    fake.write_text(FAKE_SHIM.format(python=sys.executable, root=str(state / "shims")))
    fake.chmod(0o755)
    (state / "shims").mkdir(parents=True)
    (state / "shims" / "mode").write_text("die")
    yield image_present(
        ProcessScrubRunner(state, image_digest="sha256:" + "a" * 64, python=str(fake), detach_timeout_s=1.0)
    )
    kill_started_vmms(tmp_path)


def test_a_scrub_vm_whose_shim_died_after_its_vmm_started_leaves_no_vmm(node: Node, runner: ProcessScrubRunner) -> None:
    out = runner.run(node.device(DEVICE), ATTACH, 60.0)
    assert not out.ok and "before scrubbing" in out.message
    assert started_vmms(runner.dir) == [], "the dead shim's VMM still runs (and locks the scrub VM's memory)"
    assert out.details.get("vmm_killed")


def test_after_a_restart_the_orphaned_scrub_vm_is_ended_before_a_second_one_starts(
    node: Node, runner: ProcessScrubRunner
) -> None:
    # A scrub in flight when the Cubelet died: its shim (hanging) and VMM run on in their own sessions.
    sid = "scrub-0123456789ab"
    spec = runner.spec(sid, node.device(DEVICE), ATTACH)
    (runner.dir / f"{sid}.json").write_text(json.dumps(spec.to_json()))
    (runner.dir / "mode").write_text("hang")
    argv = [runner.python, "-m", "cubeaccel.shim", "run", "--sandbox", sid, "--spec", str(runner.dir / f"{sid}.json")]
    old_shim = subprocess.Popen(argv, start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        old_vmm = poll(lambda: started_vmms(runner.dir) or None, 20.0, what="the orphan's VMM")[0]
        assert find_shim(sid, under=runner.dir) == old_shim.pid
        (runner.dir / "mode").write_text("die")
        # The restarted Cubelet's runner (a new object: nothing in memory) scrubs the same device again.
        restarted = image_present(
            ProcessScrubRunner(runner.dir.parent, image_digest=runner.image_digest, python=runner.python)
        )
        out = restarted.run(node.device(DEVICE), ATTACH, 60.0)
        assert not out.ok
        new = [p for p in runner.dir.glob("seen-scrub-*.json") if p.name != f"seen-{sid}.json"]
        assert len(new) == 1 and json.loads(new[0].read_text()) == [], "a second scrub VM started beside the orphan"
        assert inspect(old_vmm) is None and old_shim.wait(10.0) == -signal.SIGKILL
        assert started_vmms(runner.dir) == []
    finally:
        if old_shim.poll() is None:
            os.kill(old_shim.pid, signal.SIGKILL)
            old_shim.wait()
