"""CubeMaster → Cubelet requests are signed, never carry the node token: a captured request replayed, a body
swapped under a captured signature, a stale signature and the bare token are all refused, and change nothing."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from cubeaccel.cubelet.server import create_app
from cubeaccel.transport.node_sig import NodeAuth, TokenFile, sign
from tests.support.cubelet_harness import Node

TOKEN = "cbn:n1:1:" + "ab" * 32


@pytest.fixture
def tcp(tmp_path: Path) -> tuple[Node, TestClient]:
    node = Node.create(tmp_path)
    return node, TestClient(create_app(node.cubelet, local=False, token=TOKEN), raise_server_exceptions=False)


def post(client: TestClient, path: str, raw: bytes, headers: dict[str, str]) -> object:
    return client.post(path, content=raw, headers={"Content-Type": "application/json", **headers})


def test_a_signed_request_is_served_once_and_its_replay_refused(tcp: tuple[Node, TestClient]) -> None:
    node, client = tcp
    raw = json.dumps({"sandbox_id": "sb", "count": 1}).encode()
    captured = sign(TOKEN, "POST", "/v1/reservations", raw)
    r = client.post("/v1/reservations", content=raw, headers={"Content-Type": "application/json", **captured})
    assert r.status_code == 201, r.text
    client.delete("/v1/reservations/sb", auth=NodeAuth(TOKEN))
    held = node.cubelet.store.reservation("sb")
    r = client.post("/v1/reservations", content=raw, headers={"Content-Type": "application/json", **captured})
    assert (r.status_code, r.json()["error"]["code"]) == (401, "auth.invalid_credential")
    assert "replay" in r.json()["error"]["message"]
    assert node.cubelet.store.reservation("sb") == held


def test_a_swapped_body_a_stale_signature_and_the_bare_token_are_refused(tcp: tuple[Node, TestClient]) -> None:
    node, client = tcp
    signed_for = json.dumps({"sandbox_id": "small", "count": 1}).encode()
    swapped = json.dumps({"sandbox_id": "big", "count": 8}).encode()
    headers = {"Content-Type": "application/json", **sign(TOKEN, "POST", "/v1/reservations", signed_for)}
    r = client.post("/v1/reservations", content=swapped, headers=headers)
    assert (r.status_code, r.json()["error"]["message"]) == (401, "the body is not the one signed")
    stale = sign(TOKEN, "POST", "/v1/reservations", swapped, at=time.time() - 600)
    r = client.post("/v1/reservations", content=swapped, headers={"Content-Type": "application/json", **stale})
    assert r.status_code == 401 and "from this clock" in r.json()["error"]["message"]
    assert client.get("/v1/devices", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 401
    other = sign("cbn:n1:1:" + "cd" * 32, "GET", "/v1/devices", b"")  # another node's (or an old) token
    assert client.get("/v1/devices", headers=other).status_code == 401
    assert node.cubelet.store.reservations() == []


def test_the_token_file_is_read_again_when_it_changes(tmp_path: Path) -> None:
    """Re-enrolment onto the Cubelet's --node-token-file rotates its token without a restart."""
    path = tmp_path / "node.token"
    path.write_text("cbn:n1:1:" + "0" * 64 + "\n")
    tf = TokenFile(path)
    assert tf.current() == "cbn:n1:1:" + "0" * 64
    path.write_text("cbn:n1:2:" + "1" * 64 + "\n")
    assert tf.current() == "cbn:n1:2:" + "1" * 64


def test_the_cubelet_follows_a_rotated_token_file(tmp_path: Path) -> None:
    node = Node.create(tmp_path)
    path = tmp_path / "node.token"
    path.write_text(TOKEN)
    client = TestClient(create_app(node.cubelet, local=False, token=TokenFile(path).current))
    assert client.get("/v1/devices", auth=NodeAuth(TOKEN)).status_code == 200
    new = "cbn:n1:2:" + "ef" * 32
    path.write_text(new)
    assert client.get("/v1/devices", auth=NodeAuth(TOKEN)).status_code == 401
    assert client.get("/v1/devices", auth=NodeAuth(new)).status_code == 200
