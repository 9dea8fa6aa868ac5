"""A node's calls to CubeMaster (heartbeat, sandbox status push) are typed `Call`s like every other client's: each
route CubeMaster grants to nodes has one, and its reply model reads what the real CubeMaster answers."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from cubeaccel.master.api.access import NODES, POLICY
from cubeaccel.master.server import create_app
from cubeaccel.master.service import CubeMaster, MasterConfig
from cubeaccel.master.store import MasterStore
from cubeaccel.transport.master_client import Call, Calls
from cubeaccel.wire import master_api as W
from cubeaccel.wire.heartbeat import Heartbeat
from tests.support.master_builders import Credentials, group, heartbeat


def _node_calls(node: str) -> list[Call[Any]]:
    beat = Heartbeat.model_validate(heartbeat(node, group("H100-PCIe-80GB", 1)))
    return [
        Calls.heartbeat(node, beat),
        Calls.sandbox_status(node, "sb-node-calls", W.StatusBody(phase="running")),
    ]


def _matches(template: str, path: str) -> bool:
    return re.fullmatch(re.sub(r"\{[^}]+\}", "[^/]+", template), path) is not None


def test_every_route_cubemaster_grants_to_nodes_has_a_typed_call() -> None:
    calls = _node_calls("n-calls")
    node_routes = sorted(route for route, (roles, _) in POLICY.items() if roles == NODES)
    assert node_routes  # the table still names node routes
    for method, template in node_routes:
        assert any(c.method == method and _matches(template, c.path) for c in calls), (method, template)


def test_the_heartbeat_call_reads_cubemasters_ack_and_the_status_call_its_reply(tmp_path: Path) -> None:
    master = CubeMaster(MasterStore(str(tmp_path / "m.db")), MasterConfig())
    api = TestClient(create_app(master), raise_server_exceptions=False)
    api.auth = Credentials(master)
    beat, status = _node_calls("n-ack")
    r = api.request(beat.method, beat.path, json=beat.json)
    assert r.status_code == 200, r.text
    ack = beat.reply.model_validate(r.json())
    assert isinstance(ack, W.HeartbeatAck) and ack.node == "n-ack"
    r = api.request(status.method, status.path, json=status.json)
    assert r.status_code == 404 and r.json()["error"]["code"] == "sandbox.not_found"  # no such sandbox: typed refusal
