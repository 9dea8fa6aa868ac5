"""Host work on a `releasing` device (reset, holder scans, revalidation) runs outside the lifecycle lock and
outside any write transaction: a slow reset of one device delays nobody else's reservation nor any read.

Ordering is asserted with the store's event sequence, not with wall-clock thresholds: the reset is held open
by a gate until the other reservation (and the reads) are done; without the fix they would wait on the reset.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from cubeaccel.cubelet.lifecycle import ReservationRequest
from cubeaccel.cubelet.reconcile import reconcile
from cubeaccel.model.device import PciAddress
from cubeaccel.model.states import DeviceState
from tests.support.cubelet_harness import Node

S = DeviceState
GATE_S = 10.0  # the longest a held reset waits for the test; reached only when the fix is missing


class SlowReset:
    """Wraps the simulated host's reset: the reset is recorded, then it waits for the test (or GATE_S)."""

    def __init__(self, node: Node) -> None:
        self.started = threading.Event()
        self.gate = threading.Event()
        real = node.host.reset

        def reset(address: PciAddress, methods: tuple[str, ...] = ()) -> None:
            real(address, methods)
            self.started.set()
            self.gate.wait(GATE_S)

        node.host.reset = reset  # type: ignore[method-assign]


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node.create(tmp_path, "h100x4")
    yield n
    n.cubelet.store.close()


def _seq(node: Node, kind: str, *, sandbox_id: str | None = None, device_id: str | None = None, ev: str = "") -> int:
    seqs = [
        e.seq
        for e in node.cubelet.store.events(0, 100000, device_id=device_id, sandbox_id=sandbox_id)
        if e.kind == kind and (not ev or e.event == ev)
    ]
    assert seqs, f"no {kind} {ev} event"
    return seqs[-1]


def _release_in_background(node: Node, sid: str) -> threading.Thread:
    t = threading.Thread(target=node.cubelet.release, args=(sid,), daemon=True)
    t.start()
    return t


def test_a_slow_reset_does_not_delay_a_reservation_of_another_device_nor_reads(node: Node) -> None:
    a = node.cubelet.reserve("sb-a", ReservationRequest(count=1))
    node.cubelet.start("sb-a")
    slow = SlowReset(node)
    releaser = _release_in_background(node, "sb-a")
    assert slow.started.wait(GATE_S), "the release never reached the reset"
    # While device A is being reset: reads and another reservation go through.
    states = {d.id: d.state for d in node.cubelet.store.devices()}
    assert states[a.device_ids[0]] is S.RELEASING
    b = node.cubelet.reserve("sb-b", ReservationRequest(count=1))
    assert b.device_ids != a.device_ids
    slow.gate.set()
    releaser.join(GATE_S)
    assert not releaser.is_alive()
    created_b = _seq(node, "reservation_created", sandbox_id="sb-b")
    confirmed_a = _seq(node, "transition", device_id=a.device_ids[0], ev="release_confirmed")
    assert created_b < confirmed_a  # B was reserved while A's reset was still running
    assert node.device(a.device_ids[0]).state is S.ALLOCATABLE
    assert node.cubelet.store.reservation("sb-a") is None


def test_a_reconcile_pass_retrying_a_slow_release_does_not_hold_the_node(node: Node) -> None:
    """The periodic pass retries releases; it takes no lock for the whole pass, so a reset inside it stalls
    only that device."""
    node.shim.immortal_vmm.add("sb-a")
    a = node.cubelet.reserve("sb-a", ReservationRequest(count=1))
    node.cubelet.start("sb-a")
    node.cubelet.release("sb-a")  # the VMM will not die: the device stays releasing
    assert node.device(a.device_ids[0]).state is S.RELEASING
    node.shim.immortal_vmm.discard("sb-a")
    pid = node.host.find_process("vmm:sb-a")
    assert pid is not None
    node.host.unstick(pid)
    assert node.host.kill(pid)
    slow = SlowReset(node)
    passer = threading.Thread(target=reconcile, args=(node.cubelet,), daemon=True)
    passer.start()
    assert slow.started.wait(GATE_S), "the pass never reached the reset"
    b = node.cubelet.reserve("sb-b", ReservationRequest(count=1))
    node.cubelet.start("sb-b")
    slow.gate.set()
    passer.join(GATE_S)
    assert not passer.is_alive()
    created_b = _seq(node, "reservation_created", sandbox_id="sb-b")
    confirmed_a = _seq(node, "transition", device_id=a.device_ids[0], ev="release_confirmed")
    assert created_b < confirmed_a
    assert node.device(a.device_ids[0]).state is S.ALLOCATABLE
    assert [node.device(d).state for d in b.device_ids] == [S.ATTACHED]
