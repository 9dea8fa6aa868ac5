"""Every sandbox has a lifetime on the Cubelet too: one created there directly gets the node's default."""

from __future__ import annotations

from cubeaccel.cubelet.lifecycle import ReservationRequest
from cubeaccel.cubelet.reconcile import reconcile
from cubeaccel.model.states import DeviceState
from tests.support.cubelet_harness import Node


def test_a_started_sandbox_is_torn_down_at_its_lifetime_or_the_node_default(node: Node) -> None:
    default = node.cubelet.config.default_lifetime_s
    node.cubelet.reserve("sb-default", ReservationRequest(count=1))
    node.cubelet.start("sb-default")
    node.cubelet.reserve("sb-short", ReservationRequest(count=1, lifetime_s=30))
    node.cubelet.start("sb-short")
    node.clock.advance(31)
    reconcile(node.cubelet)
    assert node.cubelet.store.reservation("sb-short") is None  # torn down and released
    assert node.cubelet.store.reservation("sb-default") is not None
    kinds = [e.reason for e in node.cubelet.store.events(sandbox_id="sb-short") if e.kind == "lifetime_expired"]
    assert kinds == ["sandbox.lifetime_expired"]
    node.clock.advance(default)
    reconcile(node.cubelet)
    assert node.cubelet.store.reservation("sb-default") is None
    assert all(d.state is DeviceState.ALLOCATABLE for d in node.devices())
