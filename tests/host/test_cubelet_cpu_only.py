"""A CPU-only sandbox on a Cubelet (issue 29 item 4): reserved, started, confined and released like the rest, with no
device in its path — no device moves, its pinned memory is charged to the node's ledger, its release closes once
the VMM is gone, with nothing to reset or scrub."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cubeaccel.cubelet.lifecycle import ReservationRequest
from cubeaccel.cubelet.memory_ledger import ledger
from cubeaccel.model.contract import freeze
from cubeaccel.model.reservation_states import ReservationPhase
from cubeaccel.model.states import DeviceState
from cubeaccel.protocol.errors import CubeError
from tests.host.test_cubelet_confinement_gate import node_with
from tests.support.contract_builders import EDU_FILE, EXAMPLES, template
from tests.support.cubelet_harness import Node

BASE = freeze(template(EXAMPLES / "base.yaml"))


def cpu_only(**kw: Any) -> ReservationRequest:
    return ReservationRequest(
        **{"count": 0, "template": "base", "memory_mib": 512, "contract": BASE.to_json(), "accel_class": "none", **kw}
    )


def events_of(node: Node, sid: str) -> list[tuple[str, str | None]]:
    return [
        (str(e.event) if e.kind == "transition" else e.kind, e.reason)
        for e in node.cubelet.store.events()
        if e.sandbox_id == sid
    ]


def test_a_cpu_only_sandbox_runs_and_is_released_without_any_device_moving(tmp_path: Path) -> None:
    node = Node.create(tmp_path)
    before = node.states()
    res = node.cubelet.reserve("sb-cpu", cpu_only())
    assert res.device_ids == []
    assert node.cubelet.start("sb-cpu") is not None
    cur = node.cubelet.get_reservation("sb-cpu")
    assert cur.phase is ReservationPhase.RUNNING and cur.params.count == 0
    held = ledger(node.cubelet.store.reservations(), 1 << 20, node.cubelet.vmm_host)
    assert held.by_sandbox["sb-cpu"] >= 512 and held.locked_mib >= 512  # its pinned memory is charged
    assert node.states() == before  # every device stayed allocatable, none reserved or prepared
    node.cubelet.release("sb-cpu")
    kinds = [k for k, _ in events_of(node, "sb-cpu")]
    assert kinds.index("sandbox_running") < kinds.index("teardown_started") < kinds.index("reservation_closed")
    assert not any(e.device_id for e in node.cubelet.store.events(sandbox_id="sb-cpu"))  # no device in its path
    assert "scrub_finished" not in kinds
    assert node.cubelet.store.reservation("sb-cpu") is None and node.states() == before


@pytest.mark.parametrize(
    "req",
    [
        cpu_only(count=1),  # a CPU-only contract takes no device
        ReservationRequest(count=0, contract=freeze(template(EDU_FILE))),  # a device contract needs one
        ReservationRequest(count=0),  # no contract: an ordinary reservation of 1.. devices
    ],
)
def test_a_count_that_does_not_fit_the_contract_is_refused_and_nothing_is_reserved(
    tmp_path: Path, req: ReservationRequest
) -> None:
    node = Node.create(tmp_path)
    with pytest.raises(CubeError) as e:
        node.cubelet.reserve("sb", req)
    assert e.value.code == "reserve.invalid_count"
    assert node.cubelet.store.reservations() == []
    assert set(node.states().values()) == {DeviceState.ALLOCATABLE}


def test_a_cpu_only_sandbox_without_a_confinement_proof_never_runs_and_is_released(tmp_path: Path) -> None:
    """No device attach gates it: the guest's validation does (the VMM must be proven confined before `running`)."""
    node = node_with(tmp_path, vouch=False)
    node.cubelet.reserve("sb-unproven", cpu_only())
    node.cubelet.start("sb-unproven")
    events = events_of(node, "sb-unproven")
    kinds = [k for k, _ in events]
    assert "sandbox_running" not in kinds
    assert ("teardown_started", "vmm.not_confined") in events
    assert kinds.index("teardown_started") < kinds.index("reservation_closed")
