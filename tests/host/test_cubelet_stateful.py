"""Random reserve/start/release/fault/crash-and-reopen sequences against a real Cubelet + store.

Invariants: no device belongs to two sandboxes; a held device is never allocatable; a device is never
allocatable while a VMM that had it is alive (whatever the shim reported); every change has an event;
after restart + reconcile every device is in a defined state with consistent records.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cubeaccel.cubelet import operator
from cubeaccel.cubelet.lifecycle import ReservationRequest
from cubeaccel.cubelet.reconcile import reconcile
from cubeaccel.host.pci.simulated import Fault
from cubeaccel.model.states import TENANT_STATES, DeviceState
from cubeaccel.protocol.errors import CubeError
from tests.support.cubelet_harness import Node

SANDBOXES = st.sampled_from([f"s{i}" for i in range(3)])
DEVICE_INDEX = st.integers(0, 3)
FAULTS = st.sampled_from([Fault.HOLDER_STUCK, Fault.RESET_FAIL, Fault.VANISH, Fault.HEALTH_FAIL, Fault.IDENTITY_CHANGE])


class CubeletMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="cubelet-sm-"))
        self.node = Node.create(self.dir, "h100x4")
        self.vmms_of: dict[str, set[int]] = {}  # device id → pids of every VMM started with it

    def teardown(self) -> None:
        self.node.cubelet.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _addr(self, i: int):  # type: ignore[no-untyped-def]
        return self.node.devices()[i].address

    @rule(sid=SANDBOXES, count=st.integers(1, 3))
    def reserve(self, sid: str, count: int) -> None:
        try:
            self.node.cubelet.reserve(sid, ReservationRequest(count=count))
        except CubeError as e:
            assert e.code in ("reserve.insufficient_devices", "reserve.sandbox_conflict", "sandbox.releasing")

    @rule(sid=SANDBOXES)
    def start(self, sid: str) -> None:
        before = self.node.cubelet.store.reservation(sid)
        try:
            self.node.cubelet.start(sid)
        except CubeError as e:
            assert e.code in ("reservation.not_found", "sandbox.releasing", "prepare.revalidation_failed")
        pid = self.node.host.find_process(f"vmm:{sid}")
        if before is not None and pid is not None:
            for dev in before.device_ids:
                self.vmms_of.setdefault(dev, set()).add(pid)

    @rule(sid=SANDBOXES)
    def release(self, sid: str) -> None:
        try:
            self.node.cubelet.release(sid)
        except CubeError as e:
            assert e.code == "reservation.not_found"

    @precondition(lambda self: bool(self.node.cubelet.store.reservations()))
    @rule(data=st.data())
    def release_existing(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from([r.sandbox_id for r in self.node.cubelet.store.reservations()]))
        self.node.cubelet.release(sid)

    @rule(
        sid=SANDBOXES,
        knob=st.sampled_from(["fail_attach", "uncooperative_guest", "immortal_vmm", "failed_guest_validation"]),
    )
    def vm_fault(self, sid: str, knob: str) -> None:
        getattr(self.node.shim, knob).add(sid)

    @rule(i=DEVICE_INDEX, fault=FAULTS)
    def inject(self, i: int, fault: Fault) -> None:
        self.node.host.inject(fault, self._addr(i))

    @precondition(lambda self: any(d.state in TENANT_STATES for d in self.node.devices()))
    @rule(fault=st.sampled_from([Fault.HOLDER_STUCK, Fault.RESET_FAIL, Fault.VANISH]), data=st.data())
    def inject_on_tenant_device(self, fault: Fault, data: st.DataObject) -> None:
        tenant = [d for d in self.node.devices() if d.state in TENANT_STATES]
        self.node.host.inject(fault, data.draw(st.sampled_from(tenant)).address)

    @rule(i=DEVICE_INDEX, fault=FAULTS)
    def clear(self, i: int, fault: Fault) -> None:
        self.node.host.clear(fault, self._addr(i))

    @rule(seconds=st.sampled_from([1.0, 11.0, 61.0]))
    def tick(self, seconds: float) -> None:
        self.node.clock.advance(seconds)
        reconcile(self.node.cubelet)

    @rule()
    def crash_and_reopen(self) -> None:
        self.node.restart()
        for d in self.node.devices():
            assert d.state is not DeviceState.RELEASED
            if d.state in (DeviceState.RESERVED, DeviceState.PREPARING, DeviceState.ATTACHED):
                assert d.sandbox_id and self.node.cubelet.store.reservation(d.sandbox_id) is not None

    @precondition(
        lambda self: any(d.state in (DeviceState.QUARANTINED, DeviceState.UNHEALTHY) for d in self.node.devices())
    )
    @rule(i=DEVICE_INDEX)
    def recover(self, i: int) -> None:
        d = self.node.devices()[i]
        try:
            operator.recover(self.node.cubelet, d.id, "op", "test")
        except CubeError as e:
            assert e.code in ("operator.not_recoverable", "recover.validation_failed", "recover.vmm_alive")

    @invariant()
    def no_device_in_two_sandboxes(self) -> None:
        seen: dict[str, str] = {}
        for r in self.node.cubelet.store.reservations():
            for dev in r.device_ids:
                d = self.node.device(dev)
                if d.state in TENANT_STATES and d.sandbox_id == r.sandbox_id:
                    assert dev not in seen, f"{dev} in {seen.get(dev)} and {r.sandbox_id}"
                    seen[dev] = r.sandbox_id
        for d in self.node.devices():
            if d.state in TENANT_STATES:
                held = self.node.cubelet.store.reservation(d.sandbox_id or "")
                assert held is not None and d.id in held.device_ids

    @invariant()
    def held_devices_are_never_allocatable(self) -> None:
        for d in self.node.devices():
            if d.state is DeviceState.ALLOCATABLE:
                assert self.node.host.holders(d.address) == [], d.id
                assert d.sandbox_id is None

    @invariant()
    def never_allocatable_while_a_vmm_that_had_it_lives(self) -> None:
        for d in self.node.devices():
            if d.state is DeviceState.ALLOCATABLE:
                alive = [pid for pid in self.vmms_of.get(d.id, ()) if self.node.host.alive(pid)]
                assert not alive, f"{d.id} allocatable while VMM {alive} that had it lives"

    @invariant()
    def every_change_has_an_event(self) -> None:
        for d in self.node.devices():
            n = sum(1 for e in self.node.cubelet.store.events(0, 100000, d.id) if e.kind == "transition")
            assert n == d.generation - 1, (d.id, n, d.generation)


TestCubeletMachine = CubeletMachine.TestCase
TestCubeletMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
