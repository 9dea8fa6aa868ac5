"""The Cubelet's own edges (pure ASGI middleware, issue 18): every refusal and every mutation is audited, the
row is on disk before the reply's status line leaves, reads and shim reports that succeed are not audited, and
the reservation replies built from one snapshot still carry the timeline and a closed sandbox's failure."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from cubeaccel.cubelet.api.views import reservation_view
from cubeaccel.cubelet.reconcile import reconcile
from cubeaccel.cubelet.server import create_app
from cubeaccel.host.service.audit import AuditLog
from cubeaccel.transport.http_server import PEER_KEY
from tests.support.cubelet_harness import Node

TOKEN = "cbn:n1:1:" + "cd" * 32


def rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def local(tmp_path: Path) -> tuple[Node, TestClient, Path]:
    node = Node.create(tmp_path)
    audit = tmp_path / "audit.jsonl"
    app = create_app(node.cubelet, local=True, audit=AuditLog(audit), peer_uids=frozenset({0}))
    return node, TestClient(app, raise_server_exceptions=False), audit


def test_mutations_and_refusals_are_audited_reads_are_not(local: tuple[Node, TestClient, Path]) -> None:
    node, client, audit = local
    assert client.get("/v1/health").status_code == 200
    assert client.get("/v1/devices").status_code == 200
    assert rows(audit) == []  # reads that succeed leave no row

    r = client.post("/v1/reservations", json={"sandbox_id": "sb", "count": 1}, headers={"x-request-id": "rid-1"})
    assert r.status_code == 201, r.text
    r = client.post("/v1/reservations", json={"sandbox_id": "none", "count": 0})
    assert r.status_code == 422 and r.json()["error"]["code"] == "reserve.invalid_count"
    r = client.post("/v1/reservations", json={"sandbox_id": "bad", "count": 1, "nope": 1})
    assert r.status_code == 422 and r.json()["error"]["code"] == "api.unknown_field"
    assert client.get("/v1/devices/no-such").status_code == 404
    assert client.delete("/v1/reservations/sb").status_code == 202

    got = [(e["action"], e["outcome"], e["status"], e["reason"], e["target"]) for e in rows(audit)]
    assert got == [
        ("device:assign", "ok", 201, None, "/v1/reservations"),
        ("device:assign", "refused", 422, "reserve.invalid_count", "/v1/reservations"),
        ("device:assign", "refused", 422, "api.unknown_field", "/v1/reservations"),
        ("GET /v1/devices/{device_id}", "refused", 404, "device.not_found", "/v1/devices/no-such"),
        ("device:release", "ok", 202, None, "/v1/reservations/sb"),
    ]
    first = rows(audit)[0]
    assert (first["identity"], first["request_id"], first["node"]) == (
        "local-socket",
        "rid-1",
        node.cubelet.config.node_name,
    )


def test_a_caller_refused_by_peer_uid_is_audited_with_its_uid(tmp_path: Path) -> None:
    """Driven at the ASGI level with the kernel's credentials in the scope, as `GuardedH11` puts them."""
    node = Node.create(tmp_path)
    audit = tmp_path / "audit.jsonl"
    app = create_app(node.cubelet, local=True, audit=AuditLog(audit), peer_uids=frozenset({0}))
    dev = node.devices()[0].id
    status, body, _ = call(
        app, audit, "POST", f"/v1/devices/{dev}/quarantine", {"who": "m", "reason": "x"}, (4242, 65534)
    )
    assert (status, json.loads(body)["error"]["code"]) == (403, "auth.peer_not_allowed")
    assert node.device(dev).state.value == "allocatable"
    [row] = rows(audit)
    assert (row["action"], row["outcome"], row["reason"], row["peer_uid"], row["peer_pid"]) == (
        f"POST /v1/devices/{dev}/quarantine",  # refused before routing: the raw path, as before
        "refused",
        "auth.peer_not_allowed",
        65534,
        4242,
    )


def test_the_audit_row_is_durable_before_the_status_line_is_sent(tmp_path: Path) -> None:
    node = Node.create(tmp_path)
    audit = tmp_path / "audit.jsonl"
    app = create_app(node.cubelet, local=True, audit=AuditLog(audit), peer_uids=frozenset({0}))
    status, _, at_start = call(app, audit, "POST", "/v1/reservations", {"sandbox_id": "sb", "count": 1}, (1, 0))
    assert status == 201
    assert [(e["action"], e["outcome"], e["peer_uid"]) for e in at_start] == [("device:assign", "ok", 0)]


def test_an_unsigned_request_on_tcp_is_refused_and_audited_as_anonymous(tmp_path: Path) -> None:
    node = Node.create(tmp_path)
    audit = tmp_path / "audit.jsonl"
    client = TestClient(create_app(node.cubelet, local=False, token=TOKEN, audit=AuditLog(audit)))
    assert client.get("/v1/health").status_code == 200  # exempt: no signature needed
    r = client.post("/v1/reservations", json={"sandbox_id": "sb", "count": 1})
    assert (r.status_code, r.json()["error"]["code"]) == (401, "auth.missing_credential")
    assert node.cubelet.store.reservation("sb") is None
    [row] = rows(audit)
    assert (row["identity"], row["outcome"], row["status"], row["target"]) == (
        "anonymous",
        "refused",
        401,
        "/v1/reservations",
    )


def test_a_closed_sandbox_shows_its_failure_and_timeline(local: tuple[Node, TestClient, Path]) -> None:
    node, client, _ = local
    r = client.post("/v1/reservations", json={"sandbox_id": "sb", "count": 1})
    assert r.status_code == 201
    body = r.json()
    assert body["failure"] is None and body["reservation"]["phase"] == "reserved"
    assert [e["kind"] for e in body["timeline"]][-1] == "reservation_created"
    node.clock.advance(node.config.reservation_ttl_s + 1)
    reconcile(node.cubelet)  # never started: it expires and is torn down
    assert client.get("/v1/reservations/sb").status_code == 404
    view = reservation_view(node.cubelet, "sb")  # the reply a request racing the close gets
    assert view.reservation is None and view.devices == []
    assert view.failure is not None and view.failure.code == "reserve.expired"
    kinds = [e.kind for e in view.timeline]
    assert "reservation_expired" in kinds and kinds[-1] == "reservation_closed"
    assert set(view.model_dump()["timeline"][0]) == {"at", "kind", "event", "device_id", "to_state"}


def test_a_delete_reply_lists_the_sandbox_devices(local: tuple[Node, TestClient, Path]) -> None:
    _, client, _ = local
    held = client.post("/v1/reservations", json={"sandbox_id": "sb", "count": 2}).json()
    assert len(held["devices"]) == 2
    r = client.delete("/v1/reservations/sb")
    assert r.status_code == 202
    reply = r.json()
    assert (reply["sandbox_id"], reply["released"], reply["reservation"], reply["devices"]) == ("sb", True, None, [])


def call(
    app: FastAPI, audit_path: Path, method: str, path: str, body: Any, peer: tuple[int, int]
) -> tuple[int, bytes, list[dict[str, Any]]]:
    """One request straight into the ASGI app; returns the status, the body and the audit rows that were on
    disk when the status line was sent."""
    raw = json.dumps(body).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"cubelet"),
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(raw)),
        ],
        "client": None,
        "server": None,
        PEER_KEY: (peer[0], peer[1], peer[1]),
    }
    sent: list[Any] = []
    at_start: list[dict[str, Any]] = []
    first = True

    async def receive() -> Any:
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": raw, "more_body": False}
        await asyncio.sleep(3600)

    async def send(message: Any) -> None:
        if message["type"] == "http.response.start":
            at_start.extend(rows(audit_path))
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"), at_start


def test_a_reservation_naming_the_nodes_warm_namespace_is_refused_and_reserves_nothing(
    local: tuple[Node, TestClient, Path],
) -> None:
    """A `warm-*` id is the node's own: an idempotent reserve under it must never answer with a warm sandbox."""
    node, client, _ = local
    r = client.post("/v1/reservations", json={"sandbox_id": "warm-" + "a" * 16, "count": 1})
    assert r.status_code == 409 and r.json()["error"]["code"] == "warm.reserved_id"
    assert node.cubelet.store.reservations() == [] and {d.state.value for d in node.devices()} == {"allocatable"}
