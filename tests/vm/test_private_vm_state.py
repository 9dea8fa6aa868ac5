"""Issue 19 #12 with real MicroVMs: a sandbox's dir, its QMP/agent sockets and the template RAM snapshot are
owner-only whatever the caller's umask (the snapshot, ~150 MB of guest memory, was 0644)."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

from cubeaccel.images.builder import cache_dir
from cubeaccel.images.manifest import Manifest
from tests.support.cubelet_process import CubeletProcess
from tests.support.poll import poll
from tests.support.vmm_cleanup import kill_started_vmms
from tests.vm.test_cubelet_emulated import _kinds, edu_contract

pytestmark = pytest.mark.vm


@pytest.fixture
def emulated_open_umask(tmp_path: Path, guest_image: Manifest) -> Any:
    old = os.umask(0o022)
    p = CubeletProcess(tmp_path, "-", "--backend", "emulated", "--release-timeout", "20")
    try:
        p.start()
        yield p
    finally:
        os.umask(old)
        p.stop()
        kill_started_vmms(tmp_path)


def test_a_running_sandbox_and_its_template_snapshot_are_owner_only(
    emulated_open_umask: CubeletProcess, guest_image: Manifest
) -> None:
    p = emulated_open_umask
    p.client.reserve("vm-priv", 1, contract=edu_contract(guest_image), start=True)
    poll(lambda: "guest_checked" in _kinds(p, "vm-priv"), 180)
    sandbox_dir = p.state_dir / "shims" / "vm-priv"
    loose = {}
    for path in [p.state_dir / "shims", *sandbox_dir.rglob("*")]:
        mode = stat.S_IMODE(path.lstat().st_mode)
        if mode & 0o077:
            loose[str(path)] = oct(mode)
    for snap in (cache_dir() / "templates").rglob("state"):
        mode = stat.S_IMODE(snap.stat().st_mode)
        if mode & 0o077:
            loose[str(snap)] = oct(mode)
    assert sandbox_dir.is_dir() and any(sandbox_dir.glob("*.sock"))
    assert loose == {}
    p.client.release("vm-priv")
