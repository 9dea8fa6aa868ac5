"""CubeMaster applies what a node's heartbeat says it ended, and reconciles a node seen in a new incarnation
(issue 30 #8); a sandbox that reuses an ended one's id is left alone."""

from __future__ import annotations

from pathlib import Path

from cubeaccel.master.node_truth import NodeTruth
from cubeaccel.master.service import CubeMaster, sandbox_record
from cubeaccel.master.store import MasterStore
from cubeaccel.wire.heartbeat import EndedSandbox, NodeNews
from cubeaccel.wire.master_api import Sandbox, StatusError
from tests.support.master_builders import sandbox_row

GONE = StatusError(code="reconcile.vmm_gone", layer="cubelet", message="VMM is gone", phase="running")


def _running(m: CubeMaster, sid: str, node: str, created_at: float) -> None:
    m.store.insert_sandbox(sandbox_row(sid, 1.0, state="running", node=node, cubelet_created_at=created_at))


def _ended(sid: str, created_at: float) -> EndedSandbox:
    return EndedSandbox(sandbox_id=sid, created_at=created_at, error=GONE)


def test_ends_apply_to_that_node_and_that_reservation_only(tmp_path: Path) -> None:
    m = CubeMaster(MasterStore(str(tmp_path / "m.db")))
    _running(m, "dead", "n1", 100.0)
    _running(m, "reused", "n1", 200.0)  # a later sandbox with an id the node ended before (created_at 150)
    _running(m, "elsewhere", "n2", 100.0)
    asked: list[str] = []
    truth = NodeTruth(m, asked.append)
    news = NodeNews(
        incarnation="i1", ended=[_ended("dead", 100.0), _ended("reused", 150.0), _ended("elsewhere", 100.0)]
    )
    truth.heard("n1", news)
    states = {sid: m.get(sid).state for sid in ("dead", "reused", "elsewhere")}
    assert states == {"dead": "failed", "reused": "running", "elsewhere": "running"}
    error = m.get("dead").error
    assert error is not None and error.model_dump() == {**GONE.model_dump(), "node": "n1"}
    assert asked == ["n1"]  # first seen: reconciled
    truth.heard("n1", news)
    assert asked == ["n1"]  # the same process: nothing to reconcile
    truth.heard("n1", NodeNews(incarnation="i2"))
    assert asked == ["n1", "n1"]  # restarted


def test_a_silent_nodes_live_sandbox_is_shown_unknown(tmp_path: Path) -> None:
    m = CubeMaster(MasterStore(str(tmp_path / "m.db")))
    _running(m, "s", "n1", 100.0)
    shown = sandbox_record(m.get("s"), Sandbox, silent_nodes={"n1"})
    assert (shown.state, shown.last_known_state) == ("unknown", "running")
    assert (sandbox_record(m.get("s"), Sandbox).state, sandbox_record(m.get("s"), Sandbox).last_known_state) == (
        "running",
        None,
    )
