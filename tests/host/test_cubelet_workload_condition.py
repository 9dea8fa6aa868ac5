"""The Cubelet's side of a stalled workload service: the shim's `workload_unresponsive` is kept on the reservation
(since when, and the code calls fail with) and pushed to CubeMaster once, `workload_recovered` clears it, and a
report from another start changes nothing."""

from __future__ import annotations

from cubeaccel.cubelet.lifecycle import ReservationRequest
from cubeaccel.protocol.reports import ShimReport, ShimReportKind
from cubeaccel.wire.master_api import StatusBody
from tests.support.cubelet_harness import Node

K = ShimReportKind


def _running(node: Node, sid: str) -> tuple[list[StatusBody], str]:
    node.cubelet.reserve(sid, ReservationRequest(count=1))
    node.cubelet.start(sid)
    sent: list[StatusBody] = []
    node.status.sink = lambda s, status: sent.append(status) if s == sid else None
    res = node.cubelet.store.reservation(sid)
    assert res is not None and res.phase == "running" and res.checkpoint.start_id is not None
    return sent, res.checkpoint.start_id


def test_a_stall_is_kept_from_its_first_report_pushed_and_cleared_on_recovery(node: Node) -> None:
    sent, start_id = _running(node, "sb-stall")
    node.cubelet.handle_report(
        ShimReport("sb-stall", K.WORKLOAD_UNRESPONSIVE, (), {"reason": "workload.unresponsive"}, 100.0, start_id)
    )
    node.cubelet.handle_report(
        ShimReport("sb-stall", K.WORKLOAD_UNRESPONSIVE, (), {"message": "x" * 5000}, 130.0, start_id)
    )
    cp = node.cubelet.store.reservation("sb-stall").checkpoint  # type: ignore[union-attr]
    assert (cp.workload_unresponsive_since, cp.workload_reason) == (100.0, "workload.unresponsive")
    assert [(s.phase, s.workload and (s.workload.state, s.workload.since)) for s in sent] == [
        ("running", ("unresponsive", 100.0)),
        ("running", ("unresponsive", 100.0)),  # a repeat does not move `since`
    ]
    assert sent[1].workload is not None and len(sent[1].workload.message or "") == 2000  # bounded, still sent
    node.restart()  # kept in the journal: a restarted Cubelet still knows
    cp = node.cubelet.store.reservation("sb-stall").checkpoint  # type: ignore[union-attr]
    assert (cp.workload_unresponsive_since, cp.workload_reason) == (100.0, "workload.unresponsive")
    node.status.sink = lambda s, status: sent.append(status)

    node.cubelet.handle_report(ShimReport("sb-stall", K.WORKLOAD_RECOVERED, (), {"message": "back"}, 150.0, start_id))
    cp = node.cubelet.store.reservation("sb-stall").checkpoint  # type: ignore[union-attr]
    assert (cp.workload_unresponsive_since, cp.workload_reason) == (None, None)
    assert sent[-1].workload is not None and (sent[-1].workload.state, sent[-1].workload.since) == ("answering", 150.0)


def test_a_stall_reported_by_another_start_is_not_recorded_or_pushed(node: Node) -> None:
    sent, _ = _running(node, "sb-forged")
    node.cubelet.handle_report(ShimReport("sb-forged", K.WORKLOAD_UNRESPONSIVE, (), {}, 100.0, "0123456789abcdef"))
    assert node.cubelet.store.reservation("sb-forged").checkpoint.workload_unresponsive_since is None  # type: ignore[union-attr]
    assert sent == []
