"""A warm start refused for lack of capacity waits for capacity instead of failing (docs/warm.md, Refill), and a
reserve that waits for a device coming back is owed it before the refill (cubelet/capacity_wait.py). A real
Cubelet and SQLite store on simulated devices; the scrub VM is a gate the test opens."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from cubeaccel.cubelet.lifecycle import CubeletConfig, ReservationRequest
from cubeaccel.cubelet.store import Reservation
from cubeaccel.model.reservation_states import ReservationPhase
from cubeaccel.model.states import DeviceState
from cubeaccel.protocol.errors import CubeError
from tests.host.test_cubelet_scrub import PASSED, GatedRunner
from tests.support.cubelet_harness import Node
from tests.support.poll import poll

SHAPE = ReservationRequest(count=1, template="t-warm")
ALL = ReservationRequest(count=8)  # h100x8: every device


def _idle(node: Node) -> None:
    """The refill's warm starts have all ended (their threads are done)."""
    poll(lambda: not node.cubelet.warm._inflight, 20, what="no warm start in flight")


def _warm(node: Node) -> list[Reservation]:
    return [r for r in node.cubelet.store.reservations() if r.phase is ReservationPhase.WARM]


def test_a_warm_start_refused_for_lack_of_devices_waits_without_backoff_and_refills_once_a_device_is_back(
    node: Node,
) -> None:
    c, warm = node.cubelet, node.cubelet.warm
    c.reserve("tenant-a", ALL)  # the node is full
    warm.set_pool(SHAPE, 1)
    assert len(warm.refill_once()) == 1
    _idle(node)
    (view,) = warm.views()
    assert (view.failures, view.backoff_s, view.waiting_for) == (0, 0.0, "reserve.insufficient_devices")
    assert "warm_start_failed" not in node.kinds()
    assert warm.refill_once() == []  # nothing came back: no retry churn
    c.release("tenant-a")  # the devices come back (the simulated scrub passes at once)
    poll(lambda: all(s is DeviceState.ALLOCATABLE for s in node.states().values()), 20)
    assert len(warm.refill_once()) == 1  # at once: no backoff to sit out
    poll(lambda: len(_warm(node)) == 1, 20, what="the pool refilled")
    (view,) = warm.views()
    assert (view.failures, view.backoff_s, view.waiting_for) == (0, 0.0, None)


def test_the_refill_loop_is_woken_by_a_device_coming_back(node: Node) -> None:
    c, warm = node.cubelet, node.cubelet.warm
    c.reserve("tenant-a", ALL)
    warm.set_pool(SHAPE, 1)
    woken = threading.Event()
    c.capacity_waits.wakers.append(woken.set)
    warm.refill_once()
    _idle(node)
    woken.clear()
    c.release("tenant-a")
    assert woken.wait(10), "no capacity change was signalled when the devices came back"


def test_a_reserve_waits_for_the_device_being_scrubbed_and_the_refill_does_not_take_it(node: Node) -> None:
    """create → kill → create on a node whose killed sandbox's device is still being scrubbed, with a warm pool
    below its size: the second create (two devices: the one free and the one coming back) waits, the refill does
    not take the free device it is owed, and once the scrub passes the create gets both."""
    c, warm = node.cubelet, node.cubelet.warm
    gate = GatedRunner(PASSED)
    node.scrub.runner = gate
    c.reserve("filler", ReservationRequest(count=6))
    first = c.reserve("first", ReservationRequest(count=1))
    c.start("first")  # a tenant ran on it: it is scrubbed when released
    c.release("first")  # killed: its device is being scrubbed
    (back,) = first.device_ids
    poll(lambda: node.device(back).state is DeviceState.RELEASED, 20)
    (free,) = [d for d, s in node.states().items() if s is DeviceState.ALLOCATABLE]
    two = ReservationRequest(count=2)
    with pytest.raises(CubeError) as at_once:  # no wait asked: refused as before
        c.reserve("second", two)
    assert at_once.value.code == "reserve.insufficient_devices"

    got: list[Reservation | CubeError] = []

    def second() -> None:
        try:
            got.append(c.reserve("second", two, capacity_wait_s=30))
        except CubeError as e:
            got.append(e)

    t = threading.Thread(target=second, daemon=True)
    t.start()
    poll(lambda: len(c.capacity_waits) == 1, 10, what="the reserve waiting")
    warm.set_pool(SHAPE, 1)  # a refill arrives while the create waits
    assert len(warm.refill_once()) == 1
    _idle(node)
    assert _warm(node) == [] and node.device(free).state is DeviceState.ALLOCATABLE  # owed to the create
    (view,) = warm.views()
    assert (view.failures, view.waiting_for) == (0, "reserve.insufficient_devices")
    warm.start()  # the refill loop runs from here on: the device coming back wakes it
    try:
        gate.gate.set()  # the scrub passes
        t.join(20)
    finally:
        warm.stop()
    assert len(got) == 1 and isinstance(got[0], Reservation), got
    assert sorted(got[0].device_ids) == sorted([back, free])
    _idle(node)
    assert _warm(node) == [] and warm.views()[0].failures == 0  # nothing left for the pool: it waits


def test_a_reserve_with_nothing_coming_back_is_refused_at_once(node: Node) -> None:
    c = node.cubelet
    c.reserve("holder", ALL)
    with pytest.raises(CubeError) as e:
        c.reserve("late", ReservationRequest(count=1), capacity_wait_s=30)
    assert e.value.code == "reserve.insufficient_devices" and e.value.details["returning_devices"] == 0
    assert len(c.capacity_waits) == 0


def test_a_reserve_that_waited_its_bound_says_what_was_coming_back(node: Node) -> None:
    c = node.cubelet
    gate = GatedRunner(PASSED)
    node.scrub.runner = gate
    c.reserve("first", ALL)
    c.start("first")
    c.release("first")
    with pytest.raises(CubeError) as e:
        c.reserve("second", ReservationRequest(count=1), capacity_wait_s=0.3)
    assert e.value.code == "reserve.insufficient_devices"
    assert e.value.details["returning_devices"] == 8 and e.value.details["waited_s"] >= 0.3
    gate.gate.set()


def test_a_warm_start_refused_for_lockable_memory_waits_too(tmp_path: Path) -> None:
    node = Node.create(tmp_path, "h100x8", CubeletConfig(reservation_ttl_s=60, pinnable_memory_mib=256))
    warm = node.cubelet.warm
    warm.set_pool(SHAPE, 1)  # 512 MiB and the VMM's overhead: more than the node may lock
    assert len(warm.refill_once()) == 1
    _idle(node)
    (view,) = warm.views()
    assert (view.failures, view.backoff_s, view.waiting_for) == (0, 0.0, "reserve.pinned_memory_exhausted")
    assert warm.refill_once() == []  # looked at again after 2 s (the host may free memory unseen), not at once
