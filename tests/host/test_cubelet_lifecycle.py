"""Cubelet lifecycle scenarios on the simulated host: real store, real VFIO backend logic."""

from __future__ import annotations

from typing import Any

import pytest

from cubeaccel.cubelet import operator
from cubeaccel.cubelet.lifecycle import ReservationRequest
from cubeaccel.host.pci.simulated import Fault
from cubeaccel.model.states import DeviceState
from cubeaccel.protocol.errors import CubeError
from cubeaccel.protocol.reports import GuestPciDevice, GuestReport, ShimReport, ShimReportKind
from cubeaccel.wire.master_api import StatusBody
from tests.support.cubelet_harness import Node

S = DeviceState


def _sandbox_states(node: Node, sid: str) -> list[DeviceState]:
    return [d.state for d in node.devices() if d.sandbox_id == sid]


def test_host_initialization_binds_to_vfio_then_makes_devices_allocatable(node: Node) -> None:
    assert set(node.states().values()) == {S.ALLOCATABLE}
    writes = node.host.writes()
    first = writes[:3]
    assert first == [
        "0000:10:00.0/driver_override=vfio-pci",
        "drivers/nvidia/unbind=0000:10:00.0",
        "drivers_probe=0000:10:00.0",
    ]
    assert not any("new_id" in w for w in writes)


def test_bind_failure_at_host_init_leaves_the_device_unhealthy(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from cubeaccel.host.pci.simulated import SimulatedPciHost
    from cubeaccel.model.device import PciAddress

    SimulatedPciHost("h100x2", tmp_path / "host.json").inject(Fault.BIND_FAIL, PciAddress.parse("0000:11:00.0"))
    node = Node.create(tmp_path, "h100x2")
    d = node.device("vfio-0000:11:00.0")
    assert d.state is S.UNHEALTHY and d.reason == "backend.bind_failed"
    assert node.device("vfio-0000:10:00.0").state is S.ALLOCATABLE


def test_full_cycle_returns_devices_only_after_vmm_exit_and_reset(node: Node) -> None:
    res = node.cubelet.reserve("sb-1", ReservationRequest(count=2))
    assert _sandbox_states(node, "sb-1") == [S.RESERVED, S.RESERVED]
    node.cubelet.start("sb-1")
    assert _sandbox_states(node, "sb-1") == [S.ATTACHED, S.ATTACHED]
    node.cubelet.release("sb-1")
    assert _sandbox_states(node, "sb-1") == []
    for dev_id in res.device_ids:
        d = node.device(dev_id)
        assert d.state is S.ALLOCATABLE and d.sandbox_id is None
        assert node.host.reset_count(d.address) == 2  # after the tenant's VMM, and again after the scrub VM
        scrub = [e.kind for e in node.cubelet.store.events(device_id=dev_id) if e.kind.startswith("scrub_")]
        assert scrub == ["scrub_started", "scrub_finished"]
        trail = [e.event for e in node.cubelet.store.events(device_id=dev_id) if e.kind == "transition"]
        assert trail[-6:] == ["reserve", "prepare", "attach_succeeded", "teardown", "release_confirmed", "revalidated"]
    assert node.cubelet.store.reservation("sb-1") is None
    assert node.repairs() == []


def test_multi_device_reservation_prefers_one_numa_node(node: Node) -> None:
    res = node.cubelet.reserve("sb-numa", ReservationRequest(count=3))
    numa = {node.device(i).numa_node for i in res.device_ids}
    assert len(numa) == 1


def test_reservation_is_all_or_nothing(node: Node) -> None:
    node.cubelet.reserve("a", ReservationRequest(count=6))
    with pytest.raises(CubeError) as err:
        node.cubelet.reserve("b", ReservationRequest(count=3))
    assert err.value.code == "reserve.insufficient_devices"
    assert sum(1 for s in node.states().values() if s is S.ALLOCATABLE) == 2
    assert node.cubelet.store.reservation("b") is None


def test_reservation_is_idempotent_per_sandbox_and_refuses_changed_parameters(node: Node) -> None:
    a = node.cubelet.reserve("sb", ReservationRequest(count=2))
    b = node.cubelet.reserve("sb", ReservationRequest(count=2))
    assert a.device_ids == b.device_ids
    with pytest.raises(CubeError) as err:
        node.cubelet.reserve("sb", ReservationRequest(count=3))
    assert err.value.code == "reserve.sandbox_conflict" and err.value.status == 409
    assert len(node.cubelet.store.reservation("sb").device_ids) == 2  # type: ignore[union-attr]


@pytest.mark.parametrize("count", [0, -1, 65, 10**12])
def test_bad_counts_are_refused_and_change_nothing(node: Node, count: int) -> None:
    before = node.cubelet.store.events()
    with pytest.raises(CubeError) as err:
        node.cubelet.reserve("sb", ReservationRequest(count=count))
    assert err.value.code == "reserve.invalid_count"
    assert node.cubelet.store.events() == before


def test_label_selector_picks_only_matching_devices(tmp_path) -> None:  # type: ignore[no-untyped-def]
    node = Node.create(tmp_path, "2xh100,2xt4")
    res = node.cubelet.reserve("t4", ReservationRequest(count=2, labels=(("model", "T4-16GB"),)))
    assert {node.device(i).labels["model"] for i in res.device_ids} == {"T4-16GB"}
    with pytest.raises(CubeError):
        node.cubelet.reserve("t4b", ReservationRequest(count=1, labels=(("model", "T4-16GB"),)))


def test_holder_that_never_lets_go_is_quarantined_after_the_release_timeout(node: Node) -> None:
    res = node.cubelet.reserve("sb", ReservationRequest(count=1))
    dev = res.device_ids[0]
    node.cubelet.start("sb")
    node.host.inject(Fault.HOLDER_STUCK, node.address(dev))
    node.cubelet.release("sb")
    assert node.device(dev).state is S.RELEASING  # waiting, never allocatable
    node.clock.advance(11)
    node.cubelet.try_release("sb")
    d = node.device(dev)
    assert d.state is S.QUARANTINED and d.reason == "release.holder_stuck"
    assert node.cubelet.store.reservation("sb") is None


def test_reset_failure_quarantines(node: Node) -> None:
    res = node.cubelet.reserve("sb", ReservationRequest(count=1))
    dev = res.device_ids[0]
    node.cubelet.start("sb")
    node.host.inject(Fault.RESET_FAIL, node.address(dev))
    node.cubelet.release("sb")
    d = node.device(dev)
    assert d.state is S.QUARANTINED and d.reason == "backend.reset_failed"


def test_uncooperative_guest_detach_timeout_still_releases_after_vmm_exit(node: Node) -> None:
    node.shim.uncooperative_guest.add("sb")
    res = node.cubelet.reserve("sb", ReservationRequest(count=1))
    node.cubelet.start("sb")
    node.cubelet.release("sb")
    assert "detach_timeout" in [e.event for e in node.cubelet.store.events() if e.sandbox_id == "sb"]
    assert node.device(res.device_ids[0]).state is S.ALLOCATABLE


def test_vmm_that_will_not_die_keeps_device_out_and_then_quarantines(node: Node) -> None:
    node.shim.uncooperative_guest.add("sb")
    node.shim.immortal_vmm.add("sb")
    res = node.cubelet.reserve("sb", ReservationRequest(count=1))
    dev = res.device_ids[0]
    node.cubelet.start("sb")
    node.cubelet.release("sb")
    assert node.device(dev).state is S.RELEASING
    # Its shim is gone after the stop and the VMM is not: SIGKILL at once (nothing else will stop it), then
    # the grace for the kernel to reap it; quarantine only once the release timeout has passed too.
    res_now = node.cubelet.store.reservation("sb")
    assert res_now is not None and res_now.checkpoint.kill_at is not None
    node.clock.advance(5)
    node.cubelet.try_release("sb")
    assert node.device(dev).state is S.RELEASING
    node.clock.advance(6)
    node.cubelet.try_release("sb")
    d = node.device(dev)
    assert d.state is S.QUARANTINED and d.reason == "release.vmm_not_exited"
    with pytest.raises(CubeError) as err:  # the VMM still runs (and holds it): recovery must refuse
        operator.recover(node.cubelet, dev, "alice", "try")
    assert err.value.code == "recover.vmm_alive"


def test_detach_confirmed_while_the_vmm_survives_never_frees_the_device(node: Node) -> None:
    """The guest let go (device_del completed, no holder left), but the VMM outlives SIGKILL: quarantine, and no
    operator `recover` while that VMM lives — only its exit makes the device revalidatable."""
    node.shim.immortal_vmm.add("sb")
    res = node.cubelet.reserve("sb", ReservationRequest(count=1))
    dev = res.device_ids[0]
    node.cubelet.start("sb")
    node.cubelet.release("sb")
    assert "device_detached" in [e.event for e in node.cubelet.store.events() if e.sandbox_id == "sb"]
    assert node.host.holders(node.address(dev)) == []
    assert node.device(dev).state is S.RELEASING
    node.clock.advance(11)
    node.cubelet.try_release("sb")
    node.clock.advance(11)
    node.cubelet.try_release("sb")
    d = node.device(dev)
    assert d.state is S.QUARANTINED and d.reason == "release.vmm_not_exited"
    with pytest.raises(CubeError) as err:
        operator.recover(node.cubelet, dev, "alice", "the guest said it let go")
    assert err.value.code == "recover.vmm_alive" and err.value.layer == "cubelet"
    vmm = node.host.find_process("vmm:sb")
    assert vmm is not None
    node.host.unstick(vmm)
    assert node.host.kill(vmm)
    node.cubelet.try_release("sb")
    assert node.cubelet.store.reservation("sb") is None  # VMM and shim gone: the reservation closes
    assert operator.recover(node.cubelet, dev, "alice", "VMM gone now").state is S.ALLOCATABLE


def test_attach_failure_releases_devices_that_were_never_attached(node: Node) -> None:
    node.shim.fail_attach.add("sb")
    res = node.cubelet.reserve("sb", ReservationRequest(count=2))
    node.cubelet.start("sb")
    for dev in res.device_ids:
        assert node.device(dev).state is S.ALLOCATABLE
        events = [e.event for e in node.cubelet.store.events(device_id=dev) if e.kind == "transition"]
        assert "attach_failed" in events and "attach_succeeded" not in events


def test_guest_validation_failure_tears_down_and_cubelet_decides_device_fate(node: Node) -> None:
    node.shim.failed_guest_validation.add("sb")
    res = node.cubelet.reserve("sb", ReservationRequest(count=1))
    node.cubelet.start("sb")
    assert node.device(res.device_ids[0]).state is S.ALLOCATABLE
    assert "teardown_started" in node.kinds("sb")


def test_device_vanishing_while_attached_is_kept_and_unhealthy(node: Node) -> None:
    res = node.cubelet.reserve("sb", ReservationRequest(count=2))
    node.cubelet.start("sb")
    gone, other = res.device_ids
    node.host.inject(Fault.VANISH, node.address(gone))
    from cubeaccel.cubelet.reconcile import reconcile

    reconcile(node.cubelet)
    d = node.device(gone)
    assert d.state is S.UNHEALTHY and d.reason == "host.device_missing" and d.sandbox_id == "sb"
    assert node.device(other).state is S.ALLOCATABLE  # its sandbox was torn down and it came back clean
    assert "unhealthy" in node.repairs()


def test_identity_change_at_same_address_is_never_handed_out(node: Node) -> None:
    from cubeaccel.cubelet.reconcile import reconcile

    dev = node.devices()[0]
    node.host.inject(Fault.IDENTITY_CHANGE, dev.address)
    reconcile(node.cubelet)
    d = node.device(dev.id)
    assert d.state is S.UNHEALTHY and d.reason == "host.identity_changed"


def test_unstarted_reservation_expires_after_ttl_with_an_event(node: Node) -> None:
    from cubeaccel.cubelet.reconcile import reconcile

    res = node.cubelet.reserve("sb", ReservationRequest(count=1))
    node.clock.advance(61)
    reconcile(node.cubelet)
    assert node.device(res.device_ids[0]).state is S.ALLOCATABLE
    assert "reservation_expired" in node.kinds("sb")


def test_operator_verbs_are_audited_and_recover_revalidates(node: Node) -> None:
    dev = node.devices()[0].id
    q = operator.quarantine(node.cubelet, dev, "alice", "suspect ECC errors")
    assert q.state is S.QUARANTINED
    r = operator.recover(node.cubelet, dev, "bob", "ECC clean")
    assert r.state is S.ALLOCATABLE
    d = operator.disable(node.cubelet, dev, "carol", "maintenance")
    assert d.state is S.DISABLED
    e = operator.enable(node.cubelet, dev, "carol", "done")
    assert e.state is S.ALLOCATABLE
    audits = [
        (ev.event, ev.details.get("who"), ev.details.get("why"))
        for ev in node.cubelet.store.events(device_id=dev)
        if ev.actor == "operator"
    ]
    assert audits == [
        ("quarantine", "alice", "suspect ECC errors"),
        ("recover", "bob", "ECC clean"),
        ("disable", "carol", "maintenance"),
        ("enable", "carol", "done"),
    ]
    with pytest.raises(CubeError) as err:
        operator.quarantine(node.cubelet, dev, "", "x")
    assert err.value.code == "operator.audit_required"


def test_disabling_a_device_in_use_is_refused(node: Node) -> None:
    res = node.cubelet.reserve("sb", ReservationRequest(count=1))
    with pytest.raises(CubeError) as err:
        operator.disable(node.cubelet, res.device_ids[0], "alice", "maintenance")
    assert err.value.code == "device.in_use"
    assert node.device(res.device_ids[0]).state is S.RESERVED


def test_a_shim_still_starting_its_vmm_is_not_mistaken_for_a_dead_vm(node: Node) -> None:
    from cubeaccel.cubelet.reconcile import reconcile

    node.shim.slow_start.add("sb")
    res = node.cubelet.reserve("sb", ReservationRequest(count=1))
    dev = res.device_ids[0]
    node.cubelet.start("sb")
    assert reconcile(node.cubelet) == []  # shim alive, no VMM yet: starting, not gone
    assert node.device(dev).state is S.PREPARING
    node.shim.finish_start("sb")
    assert node.device(dev).state is S.ATTACHED


@pytest.mark.parametrize(
    ("facts", "shim", "vmm", "gone"),
    [
        ({}, None, None, True),  # never started: nothing can hold it
        ({"shim_started": True}, True, False, False),  # shim alive, VMM not (yet) there: may still appear
        ({"shim_started": True}, False, False, True),
        ({"shim_started": True, "shim_exited": True}, True, False, True),  # its final report: it starts nothing
        ({"shim_started": True, "shim_exited": True}, True, True, False),  # …but a live VMM is a live VMM
        ({"shim_started": True}, True, True, False),
        ({"shim_started": True}, None, None, None),  # cannot tell: the caller quarantines
    ],
)
def test_vmm_gone_needs_host_evidence_that_no_vmm_can_appear(
    facts: dict[str, Any], shim: bool | None, vmm: bool | None, gone: bool | None
) -> None:
    from cubeaccel.cubelet.lifecycle import Cubelet
    from cubeaccel.cubelet.shim_driver import ShimStatus
    from cubeaccel.cubelet.store import Reservation
    from cubeaccel.model.checkpoint import ReservationCheckpoint
    from cubeaccel.model.reservation_params import ReservationParams
    from cubeaccel.model.reservation_states import ReservationPhase

    res = Reservation(
        "sb", ReservationParams(), [], ReservationPhase.RELEASING, 0.0, None, ReservationCheckpoint(**facts)
    )
    assert Cubelet.vmm_gone(res, ShimStatus(shim, vmm)) is gone


def test_a_shim_that_never_starts_its_vmm_is_torn_down_after_the_startup_timeout(node: Node) -> None:
    from cubeaccel.cubelet.reconcile import reconcile

    node.shim.slow_start.add("sb")
    res = node.cubelet.reserve("sb", ReservationRequest(count=1))
    node.cubelet.start("sb")
    node.clock.advance(181)
    reconcile(node.cubelet)
    assert node.device(res.device_ids[0]).state is S.ALLOCATABLE
    assert "the shim did not start a VMM in time" in [
        e.reason for e in node.cubelet.store.events() if e.kind == "reconcile_repair"
    ]


def test_a_large_guest_still_preallocating_is_not_torn_down_at_the_small_guests_startup_timeout(node: Node) -> None:
    """64 GiB are touched before QEMU answers (minutes when host memory is cold): Cubelet waits as long as the
    shim's own preallocation deadline, then tears down as for any shim that never started its VMM."""
    from cubeaccel.cubelet.reconcile import reconcile
    from cubeaccel.model.start_deadlines import startup_timeout_s

    node.shim.slow_start.add("big")
    res = node.cubelet.reserve("big", ReservationRequest(count=1, memory_mib=64 * 1024))
    node.cubelet.start("big")
    node.clock.advance(181)
    reconcile(node.cubelet)
    assert node.device(res.device_ids[0]).state is not S.ALLOCATABLE
    assert not [e for e in node.cubelet.store.events() if e.kind == "reconcile_repair"]
    node.clock.advance(startup_timeout_s(64 * 1024, 180.0) - 181 + 1)
    reconcile(node.cubelet)
    assert node.device(res.device_ids[0]).state is S.ALLOCATABLE


def test_a_stale_or_forged_vmm_exited_report_frees_nothing(node: Node) -> None:
    """Reviewer's scenario: a report from an earlier start (reused sandbox id) or a forged one."""
    from cubeaccel.protocol.reports import ShimReport, ShimReportKind

    node.shim.slow_start.add("sb")
    res = node.cubelet.reserve("sb", ReservationRequest(count=1))
    dev = res.device_ids[0]
    node.cubelet.start("sb")
    for start_id in (None, "0123456789abcdef"):
        node.cubelet.handle_report(ShimReport("sb", ShimReportKind.VMM_EXITED, (dev,), {}, 0.0, start_id))
    assert node.device(dev).state is S.PREPARING
    assert [e.reason for e in node.cubelet.store.events() if e.kind == "shim_report_rejected"] == [
        "shim.report_stale",
        "shim.report_stale",
    ]
    # Even a genuine vmm_exited is not evidence while the shim lives: it might still start a VMM.
    genuine = node.cubelet.store.reservation("sb").checkpoint.start_id  # type: ignore[union-attr]
    node.shim.slow_start.discard("sb")
    node.host.kill = lambda pid: False  # type: ignore[method-assign]  # shim and VMM both refuse to die
    node.cubelet.handle_report(ShimReport("sb", ShimReportKind.VMM_EXITED, (dev,), {}, 0.0, genuine))
    assert node.device(dev).state is S.RELEASING
    assert node.cubelet.store.reservation("sb") is not None


def test_reservation_stays_open_until_its_vmm_is_gone_even_when_devices_are_quarantined(node: Node) -> None:
    node.shim.uncooperative_guest.add("sb")
    node.shim.immortal_vmm.add("sb")
    res = node.cubelet.reserve("sb", ReservationRequest(count=1))
    dev = res.device_ids[0]
    node.cubelet.start("sb")
    node.cubelet.release("sb")  # the shim is gone after its stop: its VMM is killed at once, grace starts
    node.clock.advance(5)
    node.cubelet.try_release("sb")
    assert node.device(dev).state is S.RELEASING  # not quarantined before the kill grace has passed
    node.clock.advance(6)
    node.cubelet.try_release("sb")
    assert node.device(dev).state is S.QUARANTINED
    assert node.cubelet.store.reservation("sb") is not None  # the VMM still runs: not forgotten
    assert "release_vmm_survives" in node.kinds("sb")
    with pytest.raises(CubeError) as err:
        node.cubelet.reserve("sb", ReservationRequest(count=1))
    assert err.value.code == "sandbox.releasing"


def test_fatal_aer_on_an_idle_device_takes_it_out_and_the_accepted_count_survives_restart(node: Node) -> None:
    from cubeaccel.cubelet.reconcile import reconcile

    dev = node.devices()[0]
    node.host.inject(Fault.AER_FATAL, dev.address)
    reconcile(node.cubelet)
    assert node.device(dev.id).state is S.UNHEALTHY and node.device(dev.id).reason == "host.aer_fatal"
    recovered = operator.recover(node.cubelet, dev.id, "alice", "AER checked: link retrained")
    assert recovered.state is S.ALLOCATABLE
    # Use it, then crash: the accepted count (1) must not be forgotten, or the attached device would be
    # judged against 0 and its sandbox torn down for an error the operator already accepted.
    node.cubelet.reserve("sb", ReservationRequest(count=1, labels=(("numa_node", "0"),)))
    node.cubelet.start("sb")
    assert node.device(dev.id).state is S.ATTACHED
    before = len(node.repairs())
    node.restart()
    assert node.device(dev.id).state is S.ATTACHED
    assert node.repairs()[before:] == []


def test_shim_reports_undelivered_while_cubelet_was_down_are_replayed_by_reconcile(node: Node) -> None:
    from cubeaccel.cubelet.reconcile import reconcile

    node.shim.cubelet_down.add("sb")
    res = node.cubelet.reserve("sb", ReservationRequest(count=1))
    node.cubelet.start("sb")
    dev = res.device_ids[0]
    assert node.device(dev).state is S.PREPARING  # device_attached never arrived
    node.shim.cubelet_down.clear()
    reconcile(node.cubelet)
    assert node.device(dev).state is S.ATTACHED
    assert "replayed" in node.repairs()


def test_a_shim_that_cannot_be_launched_fails_the_start_and_releases_the_devices(node: Node) -> None:
    def broken_start(spec: object) -> None:
        raise OSError(2, "No such file or directory: 'qemu-system-x86_64'")

    node.shim.start = broken_start  # type: ignore[method-assign]
    res = node.cubelet.reserve("sb", ReservationRequest(count=1))
    node.cubelet.start("sb")
    dev = res.device_ids[0]
    assert node.device(dev).state is S.ALLOCATABLE
    failed = [e for e in node.cubelet.store.events() if e.kind == "shim_report" and e.event == "attach_failed"]
    assert failed and failed[0].details["reason"] == "shim.launch_failed"
    assert node.cubelet.store.reservation("sb") is None


def _pushed(node: Node) -> list[tuple[str, StatusBody]]:
    sent: list[tuple[str, StatusBody]] = []
    node.status.sink = lambda sid, status: sent.append((sid, status))
    return sent


def test_running_only_after_guest_validation_and_cubemaster_is_told_at_once(node: Node) -> None:
    sent = _pushed(node)
    node.cubelet.reserve("sb-ok", ReservationRequest(count=1))
    node.cubelet.start("sb-ok")
    res = node.cubelet.store.reservation("sb-ok")
    assert res is not None and res.phase == "running"
    kinds = [e.event or e.kind for e in node.cubelet.store.events(sandbox_id="sb-ok")]
    assert kinds.index("guest_validated") < kinds.index("sandbox_running")
    assert sent == [("sb-ok", StatusBody(phase="running"))]


def test_a_guest_validation_failure_is_pushed_with_its_layer(node: Node) -> None:
    sent = _pushed(node)
    node.shim.failed_guest_validation.add("sb-bad")
    node.cubelet.reserve("sb-bad", ReservationRequest(count=1))
    node.cubelet.start("sb-bad")
    assert [s.phase for _, s in sent] == ["failed"]
    error = sent[0][1].error
    assert error is not None
    assert (error.code, error.layer, error.phase) == ("guest.validation_failed", "kernel_driver", "starting")
    assert "sandbox_running" not in node.kinds("sb-bad")


def test_without_a_contract_the_device_must_still_be_seen_where_it_was_plugged(node: Node) -> None:
    sent = _pushed(node)
    node.shim.slow_start.add("sb-min")
    res = node.cubelet.reserve("sb-min", ReservationRequest(count=1))
    node.cubelet.start("sb-min")
    start_id = node.cubelet.store.reservation("sb-min").checkpoint.start_id  # type: ignore[union-attr]
    dev = res.device_ids[0]

    def report(kind: ShimReportKind, **details: Any) -> None:
        node.cubelet.handle_report(ShimReport("sb-min", kind, (dev,), details, 0.0, start_id))

    report(ShimReportKind.VM_STARTED, pid=4242)
    report(ShimReportKind.DEVICE_ATTACHED, guest_address="0000:01:00.0")
    elsewhere = GuestReport(
        1,
        "6.1.0",
        pci_devices=(GuestPciDevice("0000:02:00.0", "10de", "2331", "0302"),),
    )
    report(ShimReportKind.GUEST_VALIDATED, report=elsewhere.to_json())
    assert [(s.phase, s.error and s.error.code, s.error and s.error.layer) for _, s in sent] == [
        ("failed", "compat.device_not_visible_in_guest", "host_hardware")
    ]
    assert node.device(dev).state in (S.RELEASING, S.ALLOCATABLE)


def test_health_failing_after_release_keeps_the_device_out_as_unhealthy(node: Node) -> None:
    """The VMM is gone and the reset ran, but the post-reset check finds the device broken: never allocatable."""
    res = node.cubelet.reserve("sb-hf", ReservationRequest(count=1))
    dev = res.device_ids[0]
    node.cubelet.start("sb-hf")
    node.host.inject(Fault.AER_FATAL, node.address(dev))
    node.cubelet.release("sb-hf")
    d = node.device(dev)
    assert d.state is S.UNHEALTHY and d.reason == "host.aer_fatal"
    trail = [e.event for e in node.cubelet.store.events(device_id=dev) if e.kind == "transition"]
    assert trail[-2:] == ["teardown", "health_failed"] and "revalidated" not in trail[-3:]
    assert node.host.reset_count(node.address(dev)) == 1
    assert node.cubelet.store.reservation("sb-hf") is None
