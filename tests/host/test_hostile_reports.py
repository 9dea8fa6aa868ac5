"""Issue 19 defect 1: a guest's numbers never crash the host-side judge (HTTP route, replay, handle_report)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from cubeaccel.cubelet.process_shim import ProcessShimDriver
from cubeaccel.cubelet.reconcile import reconcile
from cubeaccel.cubelet.server import create_app
from cubeaccel.protocol.reports import ShimReport, ShimReportKind
from cubeaccel.transport.node_sig import NodeAuth
from tests.support.cubelet_harness import Node

HOSTILE_REPORTS = [
    '{"agent_version": Infinity, "kernel_release": "6.1"}',
    '{"agent_version": -Infinity, "kernel_release": "6.1"}',
    '{"agent_version": NaN, "kernel_release": "6.1"}',
    '{"agent_version": 1e400, "kernel_release": "6.1"}',
    '{"agent_version": 100000000000000000000000000000, "kernel_release": "6.1"}',
    '{"agent_version": 1, "kernel_release": "6.1", "probes": ' + "[" * 200 + "]" * 200 + "}",
]


def _running(tmp_path: Path) -> tuple[Node, TestClient, str]:
    n = Node.create(tmp_path)
    client = TestClient(create_app(n.cubelet), raise_server_exceptions=False)
    assert client.post("/v1/reservations", json={"sandbox_id": "sb", "count": 1, "start": True}).status_code == 201
    res = n.cubelet.store.reservation("sb")
    assert res is not None and res.checkpoint.start_id is not None
    return n, client, res.checkpoint.start_id


def _state(n: Node) -> object:
    res = n.cubelet.store.reservation("sb")
    return n.states(), None if res is None else (res.phase, res.checkpoint.to_json()), len(n.cubelet.store.events())


@pytest.mark.parametrize("report", HOSTILE_REPORTS)
def test_a_guest_report_with_a_hostile_number_is_refused_as_422_and_changes_nothing(
    tmp_path: Path, report: str
) -> None:
    n, client, start_id = _running(tmp_path)
    before = _state(n)
    head = f'{{"sandbox_id": "sb", "kind": "guest_validated", "start_id": "{start_id}", '
    body = head + f'"details": {{"report": {report}}}}}'
    r = client.post("/v1/shim-reports", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"].startswith("api.")
    assert _state(n) == before


def test_a_vm_started_pid_beyond_pid_max_is_not_recorded(tmp_path: Path) -> None:
    n, client, start_id = _running(tmp_path)
    body = {"sandbox_id": "sb", "kind": "vm_started", "start_id": start_id, "details": {"pid": 2**40}}
    assert client.post("/v1/shim-reports", json=body).status_code == 202
    res = n.cubelet.store.reservation("sb")
    assert res is not None and res.checkpoint.vmm_pid is None


def test_handle_report_judges_an_overflowing_guest_report_as_malformed_not_a_crash(tmp_path: Path) -> None:
    """Defence in depth below the wire: a report built in-process (a replay) still gets a verdict."""
    n, _, start_id = _running(tmp_path)
    report = {"agent_version": float("inf"), "kernel_release": "6.1"}
    n.cubelet.handle_report(ShimReport("sb", ShimReportKind.GUEST_VALIDATED, (), {"report": report}, 1.0, start_id))
    checked = [e for e in n.cubelet.store.events() if e.kind == "guest_checked"]
    assert checked[-1].reason == "guest.report_malformed"
    assert reconcile(n.cubelet) is not None


def test_an_undelivered_report_with_infinity_is_skipped_at_replay(tmp_path: Path) -> None:
    driver = ProcessShimDriver(tmp_path)
    (driver.dir / "sb").mkdir(parents=True)
    good = {"sandbox_id": "sb", "kind": "vm_started", "details": {"pid": 7}, "at": 2.0}
    lines = [
        '{"sandbox_id": "sb", "kind": "guest_validated", "details": {"report": {"agent_version": Infinity}}}',
        '{"sandbox_id": "sb", "kind": "vm_started", "details": {"pid": 1e400}}',
        '{"sandbox_id": "sb", "kind": "vm_started", "details": ' + "[" * 5000 + "]" * 5000 + "}",
        json.dumps(good),
    ]
    (driver.dir / "sb" / "undelivered.jsonl").write_text("\n".join(lines) + "\n")
    assert [r.details for r in driver.pending_reports("sb")] == [{"pid": 7}]


def test_the_start_nonce_is_not_served_over_tcp(tmp_path: Path) -> None:
    """Issue 19 #13: the nonce that makes a shim report count was returned by the TCP API."""
    n, local, start_id = _running(tmp_path)
    tcp = TestClient(create_app(n.cubelet, local=False, token="node-t"), raise_server_exceptions=False)
    tcp.auth = NodeAuth("node-t")  # signed as CubeMaster signs
    replies = [
        tcp.get("/v1/reservations/sb").text,
        tcp.get("/v1/reservations").text,
        tcp.post("/v1/reservations", json={"sandbox_id": "sb", "count": 1, "start": True}).text,
    ]
    assert all(start_id not in r for r in replies)
    assert "start_id" not in tcp.get("/v1/reservations/sb").json()["reservation"]["facts"]  # absent, not null
    assert local.get("/v1/reservations/sb").json()["reservation"]["facts"]["start_id"] == start_id


def test_a_report_for_a_reservation_not_yet_started_is_refused(tmp_path: Path) -> None:
    """Before the start no shim runs and no nonce exists: a report then (a forged vm_started naming some pid)
    used to be accepted and recorded as the VMM's pid."""
    n = Node.create(tmp_path)
    client = TestClient(create_app(n.cubelet), raise_server_exceptions=False)
    assert client.post("/v1/reservations", json={"sandbox_id": "sb", "count": 1}).status_code == 201
    body = {"sandbox_id": "sb", "kind": "vm_started", "details": {"pid": 1}}
    assert client.post("/v1/shim-reports", json=body).status_code == 202
    res = n.cubelet.store.reservation("sb")
    assert res is not None and res.checkpoint.vmm_pid is None
    assert [e.reason for e in n.cubelet.store.events() if e.kind == "shim_report_rejected"] == ["shim.report_stale"]
