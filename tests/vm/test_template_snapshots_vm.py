"""A node's template snapshots are prepared for the machines its devices give: an emulated Cubelet with an `edu`
and a GPU-shaped `pci-testdev,membar=64G` (its 64 GiB BAR2 widens every root port of a template machine) and
`--prepare-shape 256` prepares one state per machine at host initialization, and a sandbox of either device
restores from its own, naming what the state was prepared for."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cubeaccel.images.manifest import Manifest
from tests.support.cubelet_process import CubeletProcess
from tests.support.poll import poll
from tests.support.vmm_cleanup import kill_started_vmms

pytestmark = pytest.mark.vm
MEMBAR = 64 << 30


@pytest.fixture
def gpu_shaped(tmp_path: Path, guest_image: Manifest) -> Any:
    p = CubeletProcess(
        tmp_path,
        "-",
        "--backend",
        "emulated",
        "--emulated-devices",
        "1",
        "--testdev-membar",
        str(MEMBAR),
        "--prepare-shape",
        "256",
        "--release-timeout",
        "20",
    )
    p.start()
    yield p
    p.stop()
    kill_started_vmms(tmp_path)


def _events(p: CubeletProcess, kind: str, sid: str | None = None) -> list[Any]:
    return [e for e in p.client.events(0, 10000).events if (e.event or e.kind) == kind and e.sandbox_id == sid]


def _vm_started(p: CubeletProcess, sid: str) -> dict[str, Any]:
    found = poll(lambda: _events(p, "vm_started", sid), 120)
    return dict(found[0].details)


def test_a_64_gib_bar_stand_in_restores_from_the_snapshot_prepared_for_its_machine(gpu_shaped: CubeletProcess) -> None:
    queued = poll(lambda: _events(gpu_shaped, "template_snapshot_queued"), 30)
    plans = {e.details["plan"] for e in queued}
    assert plans == {"shape 256 MiB x 1", "shape 256 MiB x 1, BAR 64 GiB"}  # no device (edu's windows too); 64 GiB
    ready = poll(lambda: len(_events(gpu_shaped, "template_snapshot_ready")) == 2 or None, 300)
    assert ready and _events(gpu_shaped, "template_snapshot_failed") == []
    keys = {e.details["key"] for e in _events(gpu_shaped, "template_snapshot_ready")}
    assert len(keys) == 2  # two machines: the edu's (default windows) and the 64 GiB BAR's
    for sid, model in (("snap-testdev", "pci-testdev"), ("snap-edu", "edu")):
        gpu_shaped.client.reserve(sid, 1, start=True, memory_mib=256, labels={"model": model})
        started = _vm_started(gpu_shaped, sid)
        assert (started["start"], started["cold_reason"]) == ("template", None), started
        assert started["snapshot"]["key"] in keys
        assert started["snapshot"]["prepared_for"], started["snapshot"]
        gpu_shaped.client.release(sid)
    testdev, edu = (_vm_started(gpu_shaped, s)["snapshot"]["key"] for s in ("snap-testdev", "snap-edu"))
    assert testdev != edu
