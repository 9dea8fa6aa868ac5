"""A node without the scrub image its GPUs' scrub VM boots holds those GPUs back before any tenant has one (a named
reason in the devices, the heartbeat and `GET /v1/host`), serves them once the image is there, and a GPU a missing
image already quarantined at release comes back by itself (scrubbed first) once the image is built.

Simulated host, real store; the scrub runner is a stand-in at Cubelet's boundary whose image the test removes and
builds (the real runner's image choice and verification: tests/host/test_scrub_image_choice.py)."""

from __future__ import annotations

from pathlib import Path

from cubeaccel.backends.base import AttachSpec, Problem
from cubeaccel.backends.scrub_methods import ScrubMethod
from cubeaccel.backends.vfio import VfioBackend
from cubeaccel.cubelet.heartbeat import heartbeat_body
from cubeaccel.cubelet.inventory import initialize_host
from cubeaccel.cubelet.lifecycle import Cubelet, CubeletConfig, ReservationRequest
from cubeaccel.cubelet.reconcile import reconcile
from cubeaccel.cubelet.runtime import assemble
from cubeaccel.cubelet.scrub import IMAGE_UNAVAILABLE, SCRUB_FAILED, ScrubOutcome
from cubeaccel.cubelet.shim_driver import SimulatedShimDriver
from cubeaccel.cubelet.store import Store
from cubeaccel.host.pci.simulated import SimulatedPciHost
from cubeaccel.model.device import DeviceRecord
from cubeaccel.model.states import DeviceState
from cubeaccel.protocol.errors import CubeError
from tests.support.cubelet_harness import Node

S = DeviceState
MISSING = "host.scrub_image_missing"
WHY = "no built nvidia guest image carries this Cubelet's agent: run `cubeaccel image build --vendor nvidia`"


class ImageRunner:
    """A scrub VM that boots only while its stack's image is built (`built`); scrubs pass when it boots."""

    inline = True

    def __init__(self, built: bool) -> None:
        self.built = built
        self.runs = 0
        self.booted = 0

    def image_problem(self, method: ScrubMethod) -> Problem | None:
        return None if self.built else Problem(MISSING, WHY, hard=False, held=True)

    def run(self, device: DeviceRecord, attach: AttachSpec, timeout_s: float) -> ScrubOutcome:
        self.runs += 1
        if not self.built:
            return ScrubOutcome(False, WHY, {"scrub_vm": "scrub-x", "image_problem": MISSING}, IMAGE_UNAVAILABLE)
        self.booted += 1
        return ScrubOutcome(True, "", {"method": "cuda", "image_digest": "sha256:" + "b" * 64})


def _fresh_node(tmp: Path, runner: ImageRunner) -> tuple[Cubelet, SimulatedPciHost]:
    """A node whose first start already has `runner` (Node.create starts with the simulated one)."""
    host = SimulatedPciHost("h100x2", tmp / "host.json")
    cfg = CubeletConfig(pinnable_memory_mib=1 << 20)
    backend = VfioBackend(host, allow=("10de:*",))
    cubelet = assemble(Store(tmp / "cubelet.db"), backend, SimulatedShimDriver(host), cfg, scrub_runner=runner)
    initialize_host(cubelet)
    return cubelet, host


def test_a_node_without_the_gpu_scrub_image_holds_its_gpus_before_any_tenant_and_says_why(tmp_path: Path) -> None:
    runner = ImageRunner(built=False)
    cubelet, host = _fresh_node(tmp_path, runner)
    assert {(d.state, d.reason) for d in cubelet.store.devices()} == {(S.INITIALIZED, MISSING)}
    assert not host.writes()  # held: never bound to vfio-pci
    body = heartbeat_body(cubelet, "http://127.0.0.1:1")
    assert body["ready"] is True  # the host itself can pass devices through
    assert [(p["code"], p["message"]) for p in body["host_problems"]] == [(MISSING, WHY)]
    assert body["capacity"]["allocatable"] == 0 and body["capacity"]["unavailable_reasons"] == {MISSING: 2}
    try:
        cubelet.reserve("sb", ReservationRequest(accel_class="gpu"))
        raise AssertionError("a GPU whose scrub VM cannot boot was reserved")
    except CubeError as e:
        assert e.code == "reserve.insufficient_devices"
    missing = [e for e in cubelet.store.events(0, 10000) if e.kind == "scrub_image_missing"]
    assert [(e.reason, e.details["stack"]) for e in missing] == [(MISSING, "nvidia")]
    reconcile(cubelet)  # a pass with the same answer records nothing new
    assert len([e for e in cubelet.store.events(0, 10000) if e.kind.startswith("scrub_image")]) == 1
    runner.built = True  # `cubeaccel image build --vendor nvidia`
    reconcile(cubelet)
    assert {d.state for d in cubelet.store.devices()} == {S.ALLOCATABLE}
    assert heartbeat_body(cubelet, "http://127.0.0.1:1")["host_problems"] == []
    ready = [e for e in cubelet.store.events(0, 10000) if e.kind == "scrub_image_ready"]
    assert [(e.reason, e.details["stack"], e.details["was"]["code"]) for e in ready] == [(None, "nvidia", MISSING)]
    assert runner.runs == 0  # no scrub was ever tried, none failed


def test_an_image_removed_while_gpus_are_free_takes_them_back_at_the_next_pass(node: Node) -> None:
    runner = node.scrub.runner = ImageRunner(built=False)
    reconcile(node.cubelet)
    assert {(d.state, d.reason) for d in node.devices()} == {(S.INITIALIZED, MISSING)}
    runner.built = True
    reconcile(node.cubelet)
    assert {d.state for d in node.devices()} == {S.ALLOCATABLE}
    kinds = [e.kind for e in node.cubelet.store.events(0, 10000) if e.kind == "reconcile_repair"]
    assert kinds == []


def test_a_gpu_quarantined_by_a_missing_image_at_release_recovers_once_the_image_is_built(node: Node) -> None:
    runner = node.scrub.runner = ImageRunner(built=True)
    dev = node.cubelet.reserve("tenant-a", ReservationRequest(count=1)).device_ids[0]
    node.cubelet.start("tenant-a")
    runner.built = False  # an upgrade: the images built before it carry the old agent
    node.cubelet.release("tenant-a")
    d = node.device(dev)
    assert (d.state, d.reason) == (S.QUARANTINED, IMAGE_UNAVAILABLE)  # not release.scrub_failed: nothing ran
    node.clock.advance(3600)
    for _ in range(3):  # however long the image is missing: no attempt spent, no backoff run down
        reconcile(node.cubelet)
    assert node.device(dev).state is S.QUARANTINED and runner.runs == 1
    assert not [e for e in node.cubelet.store.events(0, 10000, device_id=dev) if e.kind == "quarantine_retry"]
    runner.built = True
    reconcile(node.cubelet)
    assert node.device(dev).state is S.ALLOCATABLE and runner.booted == 1  # scrubbed before it came back
    trail = [e.event or e.kind for e in node.cubelet.store.events(0, 10000, device_id=dev)][-5:]
    assert trail == ["quarantine_retry", "retry", "scrub_started", "scrub_finished", "revalidated"]


def test_an_older_releases_quarantine_for_a_missing_image_recovers_after_the_upgrade(node: Node) -> None:
    """Before this check, a missing image failed the scrub as `release.scrub_failed` (permanent) although no scrub
    VM started; the upgraded Cubelet reads it as what it was and retries it. A scrub that ran and failed stays."""
    legacy = ScrubOutcome(False, WHY, {"scrub_vm": "scrub-0123456789ab"})  # what the older runner returned
    ran = ScrubOutcome(False, "3 pages read back non-zero", {"scrub_vm": "scrub-1", "shim_rc": 0})

    class Old:
        inline = True

        def __init__(self) -> None:
            self.outcomes = [legacy, ran]

        def run(self, device: DeviceRecord, attach: AttachSpec, timeout_s: float) -> ScrubOutcome:
            return self.outcomes.pop(0)

    node.scrub.runner = Old()
    devs = []
    for sid in ("tenant-a", "tenant-b"):
        devs.append(node.cubelet.reserve(sid, ReservationRequest(count=1)).device_ids[0])
        node.cubelet.start(sid)
        node.cubelet.release(sid)
    assert {node.device(d).reason for d in devs} == {SCRUB_FAILED}
    node.restart()  # the upgraded Cubelet; its (simulated) scrub image is there
    missing, failed = node.device(devs[0]), node.device(devs[1])
    assert missing.state is S.ALLOCATABLE
    assert (failed.state, failed.reason) == (S.QUARANTINED, SCRUB_FAILED)  # an operator looks at that one
    (moved,) = [
        e for e in node.cubelet.store.events(0, 10000, device_id=devs[0]) if e.kind == "quarantine_reclassified"
    ]
    assert moved.reason == IMAGE_UNAVAILABLE and moved.details["was"] == SCRUB_FAILED
    kinds = [e.kind for e in node.cubelet.store.events(0, 10000, device_id=devs[0])]
    after = kinds[kinds.index("quarantine_reclassified") :]
    assert [k for k in after if k in ("quarantine_retry", "scrub_started", "scrub_finished")] == [
        "quarantine_retry",
        "scrub_started",
        "scrub_finished",
    ]  # retried, then scrubbed before it came back
