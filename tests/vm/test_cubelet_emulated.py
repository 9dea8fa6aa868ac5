"""Cubelet with the emulated backend: real shim processes, real QEMU MicroVMs, the release rules for real."""

from __future__ import annotations

import contextvars
import json
import os
import signal
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from cubeaccel.images.manifest import Manifest
from cubeaccel.model.contract import freeze
from cubeaccel.model.template_spec import GuestKernel, ModulesImg
from cubeaccel.transport.telemetry import set_request_id
from cubeaccel.wire.templates import load_template
from tests.support.cubelet_process import CubeletProcess
from tests.support.poll import poll
from tests.support.vmm_cleanup import kill_started_vmms

pytestmark = pytest.mark.vm
EDU = Path(__file__).resolve().parents[2] / "src" / "cubeaccel" / "examples" / "templates" / "edu-demo.yaml"


def edu_contract(image: Manifest) -> dict[str, Any]:
    """edu-demo pinned to the image this machine built (Debian moves its kernel; the template follows)."""
    t = load_template(EDU)
    t = replace(
        t,
        guest_image_digest=image.image_digest,
        guest_kernel=GuestKernel(image.kernel_release, image.vmlinux.sha256),
        modules_img=ModulesImg(image.kernel_release, image.modules_img.sha256),
    )
    return freeze(t).to_json()


def _state(p: CubeletProcess, dev: str) -> str:
    return str(next(d.state for d in p.client.devices() if d.id == dev))


def _kinds(p: CubeletProcess, sid: str) -> list[str]:
    return [e.event or e.kind for e in p.client.events(0, 10000).events if e.sandbox_id == sid]


@pytest.fixture
def emulated(tmp_path: Path, guest_image: Manifest) -> Any:
    p = CubeletProcess(tmp_path, "-", "--backend", "emulated", "--release-timeout", "20")
    p.start()
    yield p
    p.stop()
    kill_started_vmms(tmp_path)  # this Cubelet's VMMs only, by their pid files


def test_sandbox_through_cubelet_boots_validates_and_returns_the_device(
    emulated: CubeletProcess, guest_image: Manifest
) -> None:
    rid = f"vm-story-{os.getpid()}"  # as CubeMaster's call carries its request's id (transport.telemetry)
    ctx = contextvars.copy_context()
    ctx.run(set_request_id, rid)
    body = ctx.run(emulated.client.reserve, "vm-1", 1, contract=edu_contract(guest_image), start=True)
    dev = body.devices[0].id
    poll(lambda: "guest_checked" in _kinds(emulated, "vm-1"), 120)
    assert _state(emulated, dev) == "attached"
    checked = [e for e in emulated.client.events(0, 10000).events if e.kind == "guest_checked"]
    assert checked[-1].details["violations"] == []
    assert emulated.vmm("vm-1") is not None
    emulated.client.release("vm-1")
    poll(lambda: _state(emulated, dev) == "allocatable", 60)
    poll(lambda: "reservation_closed" in _kinds(emulated, "vm-1"), 30)  # closes once shim and VMM are gone
    assert emulated.vmm("vm-1") is None
    kinds = _kinds(emulated, "vm-1")
    for k in (
        "vm_started",
        "vmm_confined",
        "memory_pinned",
        "guest_ready",
        "device_attached",
        "guest_validated",
        "device_detached",
        "vmm_exited",
        "release_confirmed",
        "revalidated",
    ):
        assert k in kinds, (k, kinds)
    # Released on host evidence: DEVICE_DELETED seen and no live VMM lists the device (the VMM's own exit
    # report may arrive after that; the release never waited for a report, only for /proc).
    assert kinds.index("device_detached") < kinds.index("release_confirmed")
    confirmed = [e for e in emulated.client.events(0, 10000).events if e.event == "release_confirmed"]
    assert confirmed[-1].details["holders"] == 0 and confirmed[-1].details["reset"] is True
    # One request id from the reserve through the shim's own log and back in its reports' transitions
    shim_lines = [json.loads(x) for x in _shim_log(emulated.state_dir, "vm-1").read_text().splitlines() if x[:1] == "{"]
    assert {x["kind"] for x in shim_lines if x.get("msg") == "report" and x.get("request_id") == rid} >= {
        "vm_started",
        "device_attached",
        "guest_validated",
    }
    cubelet_lines = [
        json.loads(x) for x in (emulated.state_dir / "cubelet.log").read_text().splitlines() if x[:1] == "{"
    ]
    assert any(x.get("event") == "attach_succeeded" and x.get("request_id") == rid for x in cubelet_lines)


def test_shim_killed_mid_sandbox_orphaned_vmm_is_stopped_then_released(emulated: CubeletProcess) -> None:
    body = emulated.client.reserve("vm-2", 1, start=True, memory_mib=256)
    dev = body.devices[0].id
    poll(lambda: _state(emulated, dev) == "attached", 120)
    shim_pid = emulated.shim("vm-2")
    assert shim_pid is not None
    vmm = emulated.vmm("vm-2")
    assert vmm is not None
    os.kill(shim_pid, signal.SIGKILL)
    poll(lambda: _state(emulated, dev) == "allocatable", 60)
    assert emulated.vmm("vm-2") is None  # Cubelet stopped the orphan before handing the device out
    repairs = [e for e in emulated.client.events(0, 10000).events if e.kind == "reconcile_repair"]
    assert any("shim died" in (e.reason or "") for e in repairs)


def test_cubelet_killed_mid_sandbox_keeps_the_vm_and_releases_after_restart(emulated: CubeletProcess) -> None:
    body = emulated.client.reserve("vm-3", 1, start=True, memory_mib=256)
    dev = body.devices[0].id
    poll(lambda: _state(emulated, dev) == "attached", 120)
    emulated.sigkill()
    emulated.start()
    assert _state(emulated, dev) == "attached"  # shim and VMM outlived Cubelet; nothing falsely freed
    emulated.client.release("vm-3")
    poll(lambda: _state(emulated, dev) == "allocatable", 60)
    assert emulated.vmm("vm-3") is None


def test_a_contract_pinning_another_guest_image_never_boots(emulated: CubeletProcess, guest_image: Manifest) -> None:
    contract = edu_contract(guest_image)
    t = load_template(EDU)
    t = replace(
        t,
        guest_image_digest="sha256:" + "0" * 64,
        guest_kernel=GuestKernel(guest_image.kernel_release, guest_image.vmlinux.sha256),
        modules_img=ModulesImg(guest_image.kernel_release, guest_image.modules_img.sha256),
    )
    contract = freeze(t).to_json()
    dev = emulated.client.reserve("vm-img", 1, contract=contract, start=True).devices[0].id
    poll(
        lambda: any(
            e.kind == "reservation_closed" for e in emulated.client.events(0, 10000).events if e.sandbox_id == "vm-img"
        ),
        60,
    )
    kinds = _kinds(emulated, "vm-img")
    assert "attach_failed" in kinds and "vm_started" not in kinds  # refused before any VMM started
    failed = next(
        e
        for e in emulated.client.events(0, 10000).events
        if e.sandbox_id == "vm-img" and e.event == "attach_failed" and e.kind == "shim_report"
    )
    assert (failed.details["reason"], failed.details["layer"]) == ("shim.image_not_found", "template")
    # The shim was started, so the scrub VM runs before the device is back (no report proves no VMM had it).
    poll(lambda: _state(emulated, dev) == "allocatable", 60)


def _shim_log(state_dir: Path, sid: str) -> Path:
    """The shim's log: live, or kept with its finished run once the release retired it (cubelet/runfiles.py)."""

    def found() -> Path | None:
        live = state_dir / "shims" / f"{sid}.log"
        kept = sorted((state_dir / "shims" / "finished").glob(f"*-{sid}/shim.log"))
        return live if live.exists() else (kept[-1] if kept else None)

    return poll(found, 30)
