"""Ready means ready, through CubeMaster, with a real MicroVM: `running` only after the guest validated, and a guest
that fails validation is `failed` with its layer at CubeMaster within 2 s of the agent's report (Cubelet pushes it).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cubeaccel.images.manifest import Manifest
from cubeaccel.wire.master_api import Sandbox
from tests.support.cubelet_process import CubeletProcess
from tests.support.master_harness import MasterProcess, emulated_cubelet, example
from tests.support.poll import poll
from tests.support.vmm_cleanup import kill_started_vmms

pytestmark = pytest.mark.vm


def edu_template(image: Manifest, name: str, **probes: Any) -> dict[str, Any]:
    doc = example(
        "edu-demo",
        metadata__name=name,
        spec__guest__image__digest=image.image_digest,
        spec__guest__kernel__version=image.kernel_release,
        spec__guest__kernel__digest=image.vmlinux.sha256,
        spec__guest__modules_img__kernel_version=image.kernel_release,
        spec__guest__modules_img__digest=image.modules_img.sha256,
    )
    if probes:
        doc["spec"]["probes"] = probes
    return doc


@pytest.fixture
def stack(tmp_path: Path, guest_image: Manifest) -> Iterator[tuple[MasterProcess, CubeletProcess]]:
    master = MasterProcess(tmp_path / "master").start()
    (tmp_path / "cubelet").mkdir()
    cubelet = emulated_cubelet(master, tmp_path / "cubelet", "vm-node")
    cubelet.start()
    try:
        poll(lambda: any(n.node == "vm-node" and n.state == "ready" for n in master.client.nodes()), 30)
        yield master, cubelet
    finally:
        cubelet.stop()
        master.stop()
        kill_started_vmms(tmp_path)  # this Cubelet's VMMs only, by their pid files


def _phase_at(sandbox: Sandbox, phase: str) -> float:
    return next(e.at for e in sandbox.timeline if e.phase == phase)


def test_a_guest_that_fails_validation_is_failed_at_cubemaster_with_its_layer_within_2s(
    stack: tuple[MasterProcess, CubeletProcess], guest_image: Manifest
) -> None:
    master, cubelet = stack
    master.client.register_template(edu_template(guest_image, "edu-needs-nvidia", modules=["nvidia"]))
    sb = master.client.create({"template": "edu-needs-nvidia", "accelerators": [{"class": "accelerator"}]})
    assert sb.state == "starting"  # placed and booting: not yet validated
    sid = sb.id
    poll(lambda: master.client.sandbox(sid).state == "failed", 120)
    row = master.client.sandbox(sid)
    assert row.error is not None
    assert row.error.layer == "modules_img" and (row.error.code or "").startswith("compat.modules_img")
    report = next(
        e
        for e in cubelet.client.events(0, 10000).events
        if e.sandbox_id == sid and e.event == "guest_validation_failed"
    )
    assert _phase_at(row, "failed") - report.at <= 2.0
    assert "ready" not in [e.phase for e in row.timeline]


def test_a_sandbox_is_running_at_cubemaster_only_after_its_guest_validated(
    stack: tuple[MasterProcess, CubeletProcess], guest_image: Manifest
) -> None:
    master, cubelet = stack
    master.client.register_template(edu_template(guest_image, "edu-ok"))
    sb = master.client.create({"template": "edu-ok", "accelerators": [{"class": "accelerator"}]})
    sid = sb.id
    poll(lambda: master.client.sandbox(sid).state == "running", 120)
    validated = next(
        e for e in cubelet.client.events(0, 10000).events if e.sandbox_id == sid and e.event == "guest_validated"
    )
    row = master.client.sandbox(sid)
    assert _phase_at(row, "ready") >= validated.at and _phase_at(row, "ready") - validated.at <= 2.0
    master.client.delete(sid)
    poll(lambda: master.client.sandbox(sid).state == "deleted", 60)
