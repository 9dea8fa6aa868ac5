"""The scrub step of the release path on the simulated host: real store, real VFIO backend logic, runners that
stand in for the scrub VM at Cubelet's own boundary (the real scrub VM runs in tests/vm/test_scrub_between_tenants.py).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from cubeaccel.backends.base import AttachSpec
from cubeaccel.cubelet.lifecycle import CubeletConfig, ReservationRequest
from cubeaccel.cubelet.reconcile import reconcile
from cubeaccel.cubelet.scrub import (
    ProcessScrubRunner,
    ScrubOutcome,
    ScrubPolicy,
    UnavailableScrubRunner,
    parse_policy,
)
from cubeaccel.model.device import DeviceRecord
from cubeaccel.model.states import DeviceState
from cubeaccel.protocol.errors import CubeError
from tests.support.cubelet_harness import Node
from tests.support.poll import poll

S = DeviceState


class GatedRunner:
    """A scrub VM that takes as long as the test says and ends as the test says."""

    inline = False

    def __init__(self, outcome: ScrubOutcome) -> None:
        self.outcome = outcome
        self.gate = threading.Event()
        self.seen: list[tuple[str, str, float]] = []
        self.returned = False

    def run(self, device: DeviceRecord, attach: AttachSpec, timeout_s: float) -> ScrubOutcome:
        self.seen.append((device.id, attach.driver, timeout_s))
        self.gate.wait(30)
        self.returned = True
        return self.outcome


PASSED = ScrubOutcome(True, "", {"method": "cuda", "bytes_zeroed": 80 << 30, "zero_ms": 1.0, "verify_ms": 2.0})


def started_tenant(node: Node, sid: str) -> str:
    res = node.cubelet.reserve(sid, ReservationRequest(count=1))
    node.cubelet.start(sid)
    return res.device_ids[0]


def kinds(node: Node, dev: str) -> list[str]:
    return [e.kind for e in node.cubelet.store.events(0, 10000, device_id=dev) if e.kind.startswith("scrub_")]


def test_device_is_allocatable_only_after_the_scrub_passed_then_reset_again(node: Node) -> None:
    runner = GatedRunner(PASSED)
    node.scrub.runner = runner
    dev = started_tenant(node, "tenant-a")
    node.cubelet.release("tenant-a")
    d = node.device(dev)
    assert (d.state, d.reason) == (S.RELEASED, "release.scrub_pending")
    assert node.cubelet.store.reservation("tenant-a") is None  # the tenant is gone; the device is not back
    assert node.host.reset_count(d.address) == 1
    with pytest.raises(CubeError) as refused:  # 8 devices, 7 free: asking for all 8 cannot be met meanwhile
        node.cubelet.reserve("tenant-b", ReservationRequest(count=8))
    assert refused.value.code == "reserve.insufficient_devices"
    reconcile(node.cubelet)  # a pass during the scrub neither revalidates it nor starts a second scrub
    assert node.device(dev).state is S.RELEASED and kinds(node, dev) == ["scrub_started"]
    runner.gate.set()
    poll(lambda: node.device(dev).state is S.ALLOCATABLE, 10)
    assert node.host.reset_count(d.address) == 2
    assert runner.seen == [(dev, "vfio-pci", 600.0)]
    events = [e for e in node.cubelet.store.events(0, 10000, device_id=dev) if e.kind.startswith("scrub_")]
    assert [e.kind for e in events] == ["scrub_started", "scrub_finished"]
    assert events[0].sandbox_id == "tenant-a" and events[0].details["policy"] == "trusted-vm"
    done = events[1].details
    assert done["ok"] is True and done["bytes_zeroed"] == 80 << 30 and done["duration_s"] >= 0
    trail = [e.event for e in node.cubelet.store.events(0, 10000, device_id=dev) if e.kind == "transition"]
    assert trail[-3:] == ["teardown", "release_confirmed", "revalidated"]


def test_a_failed_scrub_quarantines_the_device(node: Node) -> None:
    runner = GatedRunner(ScrubOutcome(False, "2 sample(s) not zero after cuMemsetD8", {"bytes_zeroed": 1 << 20}))
    runner.gate.set()
    node.scrub.runner = runner
    dev = started_tenant(node, "tenant-a")
    node.cubelet.release("tenant-a")
    poll(lambda: node.device(dev).state is S.QUARANTINED, 10)
    d = node.device(dev)
    assert d.reason == "release.scrub_failed"
    finished = [e for e in node.cubelet.store.events(0, 10000, device_id=dev) if e.kind == "scrub_finished"]
    assert finished[-1].details["ok"] is False and "not zero" in finished[-1].details["message"]
    assert node.host.reset_count(d.address) == 1  # no second reset: nothing vouches for the device now
    reconcile(node.cubelet)
    assert node.device(dev).state is S.QUARANTINED


def test_a_runner_that_raises_is_a_failed_scrub(node: Node) -> None:
    class Broken:
        inline = True

        def run(self, device: DeviceRecord, attach: AttachSpec, timeout_s: float) -> ScrubOutcome:
            raise OSError("no such file: qemu-system-x86_64")

    node.scrub.runner = Broken()
    dev = started_tenant(node, "tenant-a")
    node.cubelet.release("tenant-a")
    d = node.device(dev)
    assert (d.state, d.reason) == (S.QUARANTINED, "release.scrub_failed")


def test_a_node_without_a_scrub_runner_never_skips_a_scrub(node: Node) -> None:
    node.scrub.runner = UnavailableScrubRunner()
    dev = started_tenant(node, "tenant-a")
    node.cubelet.release("tenant-a")
    assert node.device(dev).state is S.QUARANTINED


def test_policy_none_releases_with_the_reset_only(tmp_path: Path) -> None:
    cfg = CubeletConfig(release_timeout_s=10, pinnable_memory_mib=1 << 20, scrub_policy=parse_policy(["gpu=none"]))
    node = Node.create(tmp_path, "h100x2", config=cfg)
    dev = started_tenant(node, "tenant-a")
    node.cubelet.release("tenant-a")
    d = node.device(dev)
    assert d.state is S.ALLOCATABLE and kinds(node, dev) == []
    assert node.host.reset_count(d.address) == 1


def test_a_reservation_that_never_started_owes_no_scrub(node: Node) -> None:
    res = node.cubelet.reserve("never", ReservationRequest(count=1))
    node.cubelet.release("never")
    dev = res.device_ids[0]
    assert node.device(dev).state is S.ALLOCATABLE and kinds(node, dev) == []


def test_cubelet_restarted_mid_scrub_scrubs_again(node: Node) -> None:
    runner = GatedRunner(PASSED)
    node.scrub.runner = runner
    dev = started_tenant(node, "tenant-a")
    node.cubelet.release("tenant-a")
    assert node.device(dev).reason == "release.scrub_pending"
    node.restart()  # the new process's (simulated) scrub VM runs from reconcile
    assert node.device(dev).state is S.ALLOCATABLE
    assert kinds(node, dev) == ["scrub_started", "scrub_started", "scrub_finished"]
    runner.gate.set()  # the old process's scrub VM ends late: its process is gone, nothing of it lands
    poll(lambda: runner.returned, 5)
    assert node.device(dev).state is S.ALLOCATABLE and len(kinds(node, dev)) == 3


def test_policy_parsing_refuses_what_it_does_not_know() -> None:
    assert parse_policy([])["gpu"] is ScrubPolicy.TRUSTED_VM
    assert parse_policy(["accelerator=none"])["accelerator"] is ScrubPolicy.NONE
    for bad in ("gpu", "gpu=wipe", "fpga=none"):
        with pytest.raises(CubeError) as e:
            parse_policy([bad])
        assert e.value.code == "cubelet.invalid_scrub_policy"


def test_the_process_runner_boots_only_an_image_with_this_cubelets_agent(
    node: Node, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An empty cache (or one holding only other trees' images): the scrub fails before any process starts."""
    monkeypatch.setenv("CUBEACCEL_CACHE_DIR", str(tmp_path / "empty-cache"))
    runner = ProcessScrubRunner(tmp_path / "state")
    d = node.device("vfio-0000:10:00.0")
    out = runner.run(d, AttachSpec("vfio-pci", {"host": "0000:10:00.0"}), 5.0)
    assert not out.ok and "cubeaccel image build" in out.message
    assert not (tmp_path / "state" / "shims").exists() or not any((tmp_path / "state" / "shims").iterdir())
    pinned = ProcessScrubRunner(tmp_path / "state", image_digest="sha256:" + "a" * 64)
    spec = pinned.spec("scrub-0123456789ab", d, AttachSpec("vfio-pci", {"host": "0000:10:00.0"}))
    assert spec.scrub == "cuda" and spec.workload is False and spec.devices[0].driver == "vfio-pci"
    assert spec.report == {"file": str((tmp_path / "state/shims/scrub-0123456789ab/scrub-reports.jsonl").absolute())}


def test_every_scrub_records_its_evidence_in_the_journal_and_the_audit_log(tmp_path: Path) -> None:
    from cubeaccel.host.service.audit import AuditLog, read

    (tmp_path / "node").mkdir()
    node = Node.create(tmp_path / "node", "h100x8", audit=AuditLog(tmp_path / "audit.jsonl"))
    dev = started_tenant(node, "tenant-a")
    node.cubelet.release("tenant-a")
    (done,) = [e.details for e in node.cubelet.store.events(0, 10000, device_id=dev) if e.kind == "scrub_finished"]
    (entry,) = [e for e in read(tmp_path / "audit.jsonl") if e["action"] == "device:scrubbed"]
    for record in (done, entry):
        assert record["method"] == "cuda" and record["pattern"] == "0x00"
        assert record["bytes_zeroed"] == 80 << 30 and record["pages_sampled"] >= 0 and "readback_ok" in record
        assert record["duration_s"] >= 0 and record["image_digest"] and record["reset_after"] == "ok"
    assert entry["device"] == dev and entry["sandbox"] == "tenant-a" and entry["outcome"] == "ok"
