"""The template snapshots a node plans (cubelet/snapshots.py): per template and per machine its devices give,
the machine a sandbox's start will look up, planned again when the devices change, each plan queued once."""

from __future__ import annotations

import json
import stat
from collections.abc import Sequence
from pathlib import Path

import pytest

from cubeaccel.cubelet.lifecycle import ReservationRequest
from cubeaccel.cubelet.process_shim import ProcessShimDriver
from cubeaccel.cubelet.reconcile import reconcile
from cubeaccel.cubelet.snapshots import DoneFn, Shape, TemplateSnapshots
from cubeaccel.model.bars import MachineShape
from cubeaccel.model.contract import freeze
from cubeaccel.protocol.errors import CubeError
from cubeaccel.shim.machine import shape_for
from cubeaccel.shim.template import shape_spec
from cubeaccel.shim.vmm import VmConfig
from cubeaccel.wire.shim_spec import ShimSpec
from cubeaccel.wire.snapshot import SnapshotPlan
from cubeaccel.wire.templates import load_template
from tests.support.cubelet_harness import Node

EXAMPLES = Path(__file__).resolve().parents[2] / "src" / "cubeaccel" / "examples" / "templates"
H100 = freeze(load_template(EXAMPLES / "cuda12-h100.yaml"))


class Queue:
    def __init__(self) -> None:
        self.plans: list[SnapshotPlan] = []

    def __call__(self, plans: Sequence[SnapshotPlan], done: DoneFn) -> None:
        self.plans += plans


def _machine(spec: ShimSpec) -> MachineShape:
    """The machine the shim gives this spec started from a template (the process driver's start mode), the part
    of the template key BARs decide (shim/machine.py)."""
    spec = spec.model_copy(update={"start": "template"})
    cfg = VmConfig(spec.sandbox_id, spec.memory_mib, spec.vcpus, False, Path("/k"), Path("/i"), "", Path("/s"))
    return shape_for(spec, cfg)


def _planned(plan: SnapshotPlan) -> MachineShape:
    return _machine(shape_spec(plan.memory_mib, plan.vcpus, Path("/s"), plan.memory_backend, plan.template_bars))


def _queued(node: Node) -> list[str]:
    return [str(e.details["plan"]) for e in node.cubelet.store.events() if e.kind == "template_snapshot_queued"]


def test_a_gpu_templates_snapshot_is_planned_for_the_machine_its_sandboxes_start_with(tmp_path: Path) -> None:
    """An H100's 128 GiB BAR1 widens every root port: the planned machine is the one the sandbox's spec gets,
    on the template's own image, memory and vCPUs (not the default shape on the CPU image)."""
    node = Node.create(tmp_path, "2xt4,2xh100")
    queue = Queue()
    snapshots = TemplateSnapshots(node.cubelet, queue, templates=[ReservationRequest(contract=H100, vcpus=2)])
    (plan,) = snapshots.refresh()
    assert (plan.template, plan.image_digest, plan.memory_mib, plan.vcpus) == (
        "cuda12-h100",
        H100.template.guest_image_digest,
        65536,
        2,
    )
    node.cubelet.reserve("sb", ReservationRequest(count=1, contract=H100, vcpus=2))
    spec = node.cubelet._spec("sb")
    assert _planned(plan) == _machine(spec)
    assert _machine(spec).ports[0].pref64_bytes == 512 << 30  # BAR1 + BAR3 > 128 GiB, twice 256 GiB: not 2 GiB
    assert queue.plans == [plan] and _queued(node) == [plan.label]
    assert snapshots.refresh() == [] and len(_queued(node)) == 1  # queued once


def test_shapes_without_a_template_are_planned_per_machine_and_again_when_a_device_appears(tmp_path: Path) -> None:
    node = Node.create(tmp_path, "edux1")
    queue = Queue()
    snapshots = TemplateSnapshots(node.cubelet, queue, shapes=[Shape(256)])
    (plan,) = snapshots.refresh()  # edu needs no more than the default windows
    assert plan.template is None and plan.template_bars == ()
    assert plan.image_digest == node.shim.node_facts().default_image
    node.host.add_function("h100")
    reconcile(node.cubelet)
    (wide,) = snapshots.refresh()
    assert _planned(wide).ports[0].pref64_bytes == 512 << 30
    node.cubelet.reserve("sb", ReservationRequest(count=1, accel_class="gpu", labels=(("vendor", "nvidia"),)))
    assert _machine(node.cubelet._spec("sb")) == _planned(wide)
    assert _queued(node) == [plan.label, wide.label]


def test_warm_pools_templates_are_planned_and_templates_that_always_boot_cold_are_not(tmp_path: Path) -> None:
    node = Node.create(tmp_path, "h100x2")
    queue = Queue()
    untrusted = freeze(load_template(EXAMPLES / "untrusted-tool-h100.yaml"))  # a NIC: never restored
    snapshots = TemplateSnapshots(node.cubelet, queue, templates=[ReservationRequest(contract=untrusted)])
    assert snapshots.refresh() == []
    node.cubelet.warm.set_pool(ReservationRequest(contract=H100, template="cuda12-h100"), 0)
    (plan,) = snapshots.refresh()
    assert plan.template == "cuda12-h100"


def test_a_preparation_outcome_is_an_event(tmp_path: Path) -> None:
    node = Node.create(tmp_path, "h100x1")
    snapshots = TemplateSnapshots(node.cubelet, Queue(), templates=[ReservationRequest(contract=H100)])
    (plan,) = snapshots.refresh()
    snapshots.prepared(plan, {"key": "0123456789abcdef", "created": True}, None)
    snapshots.prepared(plan, None, CubeError("template.prepare_failed", "no image", "template"))
    ready, failed = (
        [e for e in node.cubelet.store.events() if e.kind == k]
        for k in ("template_snapshot_ready", "template_snapshot_failed")
    )
    assert ready[0].details["key"] == "0123456789abcdef" and ready[0].details["template"] == "cuda12-h100"
    assert (failed[0].reason, failed[0].details["message"]) == ("template.prepare_failed", "no image")


def _preparer(tmp_path: Path, body: str) -> str:
    """A stand-in for `python -c … template prepare --plan FILE --json`: records its argv, answers `body`."""
    script = tmp_path / "fake-python"
    script.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "argv"}\n{body}\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def test_the_process_driver_runs_one_preparation_per_plan_and_reports_each(tmp_path: Path) -> None:
    from tests.support.poll import poll

    ok = 'echo \'{"key": "0123456789abcdef", "created": true, "build_s": 1.5, "state": "/x"}\''
    driver = ProcessShimDriver(tmp_path / "node", python=_preparer(tmp_path, ok), launch="spawn")
    done: list[tuple[SnapshotPlan, object, object]] = []
    plans = [SnapshotPlan(image_digest="sha256:" + "a" * 64, memory_mib=m, template_bars=()) for m in (256, 512)]
    driver.prepare_snapshots(plans, lambda p, r, e: done.append((p, r, e)))
    poll(lambda: len(done) == 2 or None, 30)
    assert [d[0] for d in done] == plans
    assert done[0][1] == {"key": "0123456789abcdef", "created": True, "build_s": 1.5} and done[0][2] is None
    argv = (tmp_path / "argv").read_text().splitlines()
    assert all("template prepare --plan" in a and a.endswith("--json") for a in argv)
    written = json.loads(Path(argv[0].split("--plan ")[1].split()[0]).read_text())
    assert written["memory_mib"] == 256


def test_a_failed_preparation_names_its_cause(tmp_path: Path) -> None:
    from tests.support.poll import poll

    answer = {"ok": False, "error": {"code": "template.prepare_failed", "message": "no image"}}
    fail = f"echo '{json.dumps(answer)}'; exit 1"
    driver = ProcessShimDriver(tmp_path / "node", python=_preparer(tmp_path, fail), launch="spawn")
    done: list[tuple[SnapshotPlan, object, CubeError | None]] = []
    driver.prepare_snapshots(
        [SnapshotPlan(image_digest="sha256:" + "a" * 64, memory_mib=256)], lambda p, r, e: done.append((p, r, e))
    )
    poll(lambda: done or None, 30)
    err = done[0][2]
    assert done[0][1] is None and err is not None
    assert (err.code, err.message) == ("template.prepare_failed", "no image")


def test_a_device_read_over_the_api_is_the_record_the_cubelet_holds(tmp_path: Path) -> None:
    from cubeaccel.wire.cubelet_api import Device

    node = Node.create(tmp_path, "t4x1,h100x1,edux1")
    for record in node.devices():
        assert Device.model_validate_json(Device.of(record).model_dump_json(by_alias=True)).record() == record
        assert Device.of(record).record().identity.bars == record.identity.bars  # compare=False: checked apart


def test_template_prepare_by_hand_shapes_the_machine_for_the_devices_of_the_nodes_cubelet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`cubeaccel template prepare FILE` asks this host's Cubelet for its devices: the H100 template's machine is
    the one of its 128 GiB BAR1 (the T4s are not admitted); with no Cubelet it says the machine is of no device."""
    from typer.testing import CliRunner

    from cubeaccel.cli import app
    from tests.support.cubelet_process import CubeletProcess

    monkeypatch.setenv("CUBEACCEL_CACHE_DIR", str(tmp_path / "empty-cache"))  # stops at the image: no QEMU needed
    runner = CliRunner()
    (tmp_path / "node").mkdir()
    cubelet = CubeletProcess(tmp_path / "node", "2xt4,2xh100").start()
    prepare = ["template", "prepare", str(EXAMPLES / "cuda12-h100.yaml"), "--json", "--state-dir"]
    try:
        r = runner.invoke(app, [*prepare, str(cubelet.state_dir)])
    finally:
        cubelet.stop()
    details = json.loads(r.output)["error"]["details"]
    assert details["plan"] == "cuda12-h100 65536 MiB x 1, BAR 128 GiB"
    assert details["shaped_for"].startswith("the 1 BAR layout(s) the template admits among the devices of the Cubelet")
    r = runner.invoke(app, [*prepare, str(tmp_path / "none")])
    details = json.loads(r.output)["error"]["details"]
    assert details["plan"] == "cuda12-h100 65536 MiB x 1" and details["shaped_for"].startswith("no device: no Cubelet")
