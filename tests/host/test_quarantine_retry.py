"""Recovery that needs no operator where none is needed: reconcile retries transient quarantines with backoff and a
bound, each attempt probed and recorded; permanent ones wait for `recover`. On the simulated host, real store."""

from __future__ import annotations

import json
from pathlib import Path

from cubeaccel.backends.base import AttachSpec
from cubeaccel.cubelet.heartbeat import heartbeat_body
from cubeaccel.cubelet.lifecycle import ReservationRequest
from cubeaccel.cubelet.reconcile import reconcile
from cubeaccel.cubelet.scrub import VM_NOT_STARTED, ScrubOutcome
from cubeaccel.host.pci.simulated import Fault
from cubeaccel.host.service.audit import AuditLog, verify
from cubeaccel.model.device import DeviceRecord
from cubeaccel.model.recovery import RETRY_LIMIT, retry_delay
from cubeaccel.model.states import DeviceState
from cubeaccel.wire.heartbeat import Heartbeat
from tests.support.cubelet_harness import Node

S = DeviceState


class ScriptedRunner:
    """Scrub VMs that end as the script says, one outcome per run (then they pass)."""

    inline = True

    def __init__(self, *outcomes: ScrubOutcome) -> None:
        self.outcomes = list(outcomes)
        self.runs = 0

    def run(self, device: DeviceRecord, attach: AttachSpec, timeout_s: float) -> ScrubOutcome:
        self.runs += 1
        return self.outcomes.pop(0) if self.outcomes else ScrubOutcome(True, "", {"method": "bar"})


NOT_BOOTED = ScrubOutcome(False, "the scrub VM failed before scrubbing: qemu exited 1", {}, VM_NOT_STARTED)


def tenant_released(node: Node, sid: str) -> str:
    dev = node.cubelet.reserve(sid, ReservationRequest(count=1)).device_ids[0]
    node.cubelet.start(sid)
    node.cubelet.release(sid)
    return dev


def retries(node: Node, dev: str) -> list[dict[str, object]]:
    return [e.details for e in node.cubelet.store.events(0, 10000, device_id=dev) if e.kind == "quarantine_retry"]


def test_a_scrub_vm_that_did_not_boot_is_retried_after_its_backoff_and_the_device_scrubbed_again(node: Node) -> None:
    runner = node.scrub.runner = ScriptedRunner(NOT_BOOTED)
    dev = tenant_released(node, "tenant-a")
    d = node.device(dev)
    assert (d.state, d.reason) == (S.QUARANTINED, "release.scrub_vm_not_started")
    node.clock.advance(retry_delay(1) - 1)
    reconcile(node.cubelet)  # not yet due
    assert node.device(dev).state is S.QUARANTINED and retries(node, dev) == []
    node.clock.advance(1)
    reconcile(node.cubelet)
    assert node.device(dev).state is S.ALLOCATABLE and runner.runs == 2  # scrubbed again before it came back
    (attempt,) = retries(node, dev)
    assert (attempt["attempt"], attempt["ok"], attempt["probe"]) == (1, True, [])
    trail = [e.event or e.kind for e in node.cubelet.store.events(0, 10000, device_id=dev)][-5:]
    assert trail == ["quarantine_retry", "retry", "scrub_started", "scrub_finished", "revalidated"]
    assert node.host.reset_count(node.address(dev)) == 3  # at release, in the retry's probe, after the passed scrub


def test_a_holder_that_went_away_is_retried_until_the_probe_passes(node: Node) -> None:
    dev = node.cubelet.reserve("sb", ReservationRequest(count=1)).device_ids[0]
    node.cubelet.start("sb")
    node.host.inject(Fault.HOLDER_STUCK, node.address(dev))
    node.cubelet.release("sb")
    node.clock.advance(11)
    node.cubelet.try_release("sb")
    assert node.device(dev).reason == "release.holder_stuck"
    node.clock.advance(retry_delay(1))
    reconcile(node.cubelet)
    (failed,) = retries(node, dev)
    assert failed["ok"] is False and failed["probe"][0]["code"] == "release.holder_stuck"  # type: ignore[index]
    assert node.device(dev).state is S.QUARANTINED
    node.host.clear(Fault.HOLDER_STUCK, node.address(dev))  # the holder goes away
    for h in node.host.holders(node.address(dev)):
        assert node.host.remove_holders(node.address(dev), h.pid)
    node.clock.advance(retry_delay(2) - 1)
    reconcile(node.cubelet)
    assert len(retries(node, dev)) == 1  # the second attempt waits twice as long
    node.clock.advance(1)
    reconcile(node.cubelet)
    assert [r["ok"] for r in retries(node, dev)] == [False, True]
    assert node.device(dev).state is S.ALLOCATABLE


def test_a_holder_that_never_goes_away_is_tried_only_up_to_the_bound(node: Node) -> None:
    dev = node.cubelet.reserve("sb", ReservationRequest(count=1)).device_ids[0]
    node.cubelet.start("sb")
    node.host.inject(Fault.HOLDER_STUCK, node.address(dev))
    node.cubelet.release("sb")
    node.clock.advance(11)
    node.cubelet.try_release("sb")
    for _ in range(RETRY_LIMIT + 3):
        node.clock.advance(retry_delay(RETRY_LIMIT + 3))
        reconcile(node.cubelet)
    made = retries(node, dev)
    assert [r["attempt"] for r in made] == list(range(1, RETRY_LIMIT + 1))
    assert made[-1]["exhausted"] is True and not any(r["exhausted"] for r in made[:-1])
    assert node.device(dev).state is S.QUARANTINED  # the operator's now


def test_permanent_reasons_wait_for_the_operator(node: Node) -> None:
    node.scrub.runner = ScriptedRunner(ScrubOutcome(False, "1 sample not zero", {"method": "cuda"}))
    scrubbed = tenant_released(node, "tenant-a")
    assert node.device(scrubbed).reason == "release.scrub_failed"
    parked = next(d.id for d in node.devices() if d.state is S.ALLOCATABLE)
    from cubeaccel.cubelet import operator

    operator.quarantine(node.cubelet, parked, "ops", "looks odd")
    node.clock.advance(24 * 3600)
    reconcile(node.cubelet)
    assert retries(node, scrubbed) == [] and retries(node, parked) == []
    assert node.device(scrubbed).state is S.QUARANTINED and node.device(parked).state is S.QUARANTINED


def test_each_retry_attempt_is_audited_with_its_probe(tmp_path: Path) -> None:
    (tmp_path / "node").mkdir()
    node = Node.create(tmp_path / "node", "h100x8", audit=AuditLog(tmp_path / "audit.jsonl"))
    node.scrub.runner = ScriptedRunner(NOT_BOOTED)
    dev = tenant_released(node, "tenant-a")
    node.clock.advance(retry_delay(1))
    reconcile(node.cubelet)
    entries = [json.loads(x) for x in (tmp_path / "audit.jsonl").read_text().splitlines()]
    mine = [(e["action"], e["outcome"]) for e in entries if e.get("device") == dev]
    start = mine.index(("device:quarantined", "ok"))
    assert mine[start:] == [
        ("device:quarantined", "ok"),
        ("device:retry_attempt", "ok"),
        ("device:retried", "ok"),
        ("device:scrub_started", "ok"),
        ("device:scrubbed", "ok"),
        ("device:reset", "ok"),
        ("device:allocatable", "ok"),
    ]
    attempt = next(e for e in entries if e["action"] == "device:retry_attempt")
    assert (attempt["attempt"], attempt["probe"], attempt["quarantine_reason"]) == (1, [], VM_NOT_STARTED)
    assert verify(tmp_path / "audit.jsonl") == []


def test_the_heartbeat_counts_unavailable_devices_per_reason(node: Node) -> None:
    from cubeaccel.cubelet import operator

    node.scrub.runner = ScriptedRunner(NOT_BOOTED, NOT_BOOTED)
    tenant_released(node, "a")
    tenant_released(node, "b")
    free = [d.id for d in node.devices() if d.state is S.ALLOCATABLE]
    operator.quarantine(node.cubelet, free[0], "ops", "suspect")
    operator.disable(node.cubelet, free[1], "ops", "maintenance")
    body = heartbeat_body(node.cubelet, "http://127.0.0.1:1")
    sent = Heartbeat.model_validate(body).capacity  # as CubeMaster reads it
    assert sent.unavailable_reasons == {
        "release.scrub_vm_not_started": 2,
        "operator.quarantine": 1,
        "operator.disabled": 1,
    }
    assert (sent.by_state["quarantined"], sent.by_state["disabled"], sent.allocatable) == (3, 1, 4)


def test_an_operators_recover_of_a_device_whose_scrub_failed_scrubs_it_before_it_is_allocatable(node: Node) -> None:
    """The operator vouches for the hardware, not for what the last tenant left in its memory."""
    from cubeaccel.cubelet import operator

    runner = node.scrub.runner = ScriptedRunner(ScrubOutcome(False, "1 sample not zero", {"method": "cuda"}))
    dev = tenant_released(node, "tenant-a")
    assert node.device(dev).reason == "release.scrub_failed" and runner.runs == 1
    back = operator.recover(node.cubelet, dev, "ops", "reseated the card")
    assert back.state is S.ALLOCATABLE and runner.runs == 2  # scrubbed again, then revalidated
    trail = [e for e in node.cubelet.store.events(0, 10000, device_id=dev)]
    steps = [e.event or e.kind for e in trail][-4:]
    assert steps == ["recover_scrub", "scrub_started", "scrub_finished", "revalidated"]
    recovered = next(e for e in trail if e.event == "recover_scrub")
    assert (recovered.details["scrub_owed"], recovered.details["tenant"]) == (True, "tenant-a")


def test_a_recover_that_cannot_scrub_leaves_the_device_quarantined(node: Node) -> None:
    from cubeaccel.cubelet import operator

    node.scrub.runner = ScriptedRunner(ScrubOutcome(False, "first", {}), ScrubOutcome(False, "again", {}))
    dev = tenant_released(node, "tenant-a")
    after = operator.recover(node.cubelet, dev, "ops", "try again")
    assert (after.state, after.reason) == (S.QUARANTINED, "release.scrub_failed")


def test_a_recover_of_a_device_no_tenant_touched_since_its_scrub_owes_none(node: Node) -> None:
    from cubeaccel.cubelet import operator

    runner = node.scrub.runner = ScriptedRunner()
    tenant_released(node, "tenant-a")  # scrubbed and back
    parked = next(d.id for d in node.devices() if d.state is S.ALLOCATABLE)
    operator.quarantine(node.cubelet, parked, "ops", "looks odd")
    runs = runner.runs
    assert operator.recover(node.cubelet, parked, "ops", "fine").state is S.ALLOCATABLE and runner.runs == runs
    last = node.cubelet.store.events(0, 10000, device_id=parked)[-1]
    assert (last.event, last.details["scrub_owed"], last.details["tenant"]) == ("recover", False, None)
