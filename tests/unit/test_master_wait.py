"""CubeMaster's `?wait=` on create and show: the reply comes when the sandbox is running (its workload service
is up: the shim waits for it before validation), failed with code and layer, or when the wait ends."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from cubeaccel.master.server import create_app
from cubeaccel.master.service import CubeMaster, MasterConfig
from cubeaccel.master.store import MasterStore
from tests.support.master_builders import Credentials, group, heartbeat, sandbox_row


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[CubeMaster, TestClient]]:
    master = CubeMaster(MasterStore(str(tmp_path / "m.db")), MasterConfig(staleness_s=30.0))
    master.store.heartbeat(heartbeat("n1", group("H100-PCIe-80GB", 2), url="http://127.0.0.1:9"), time.time(), 30.0)
    master.store.insert_sandbox(sandbox_row("sb-w", time.time(), tenant="default", state="starting", node="n1"))
    client = TestClient(create_app(master))
    client.auth = Credentials(master)
    yield master, client
    master.store.close()


def _watch(client: TestClient, wait: float) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(client.get("/v1/sandboxes/sb-w", params={"wait": wait})))
    thread.start()
    return thread, out


def test_a_watch_returns_when_the_node_says_running(api: tuple[CubeMaster, TestClient]) -> None:
    _, client = api
    thread, out = _watch(client, 60)
    thread.join(1.0)
    assert thread.is_alive()  # held: the sandbox is still starting
    r = client.put("/v1/nodes/n1/sandboxes/sb-w/status", json={"phase": "running"})
    assert r.status_code == 200, r.text
    thread.join(30)
    assert not thread.is_alive() and out[0].status_code == 200
    assert out[0].json()["state"] == "running"


def test_a_watch_returns_the_failure_with_code_and_layer(api: tuple[CubeMaster, TestClient]) -> None:
    _, client = api
    thread, out = _watch(client, 60)
    error = {"code": "workload.not_up", "layer": "workload", "message": "no answer"}
    assert client.put("/v1/nodes/n1/sandboxes/sb-w/status", json={"phase": "failed", "error": error}).status_code == 200
    thread.join(30)
    body = out[0].json()
    assert body["state"] == "failed"
    assert (body["error"]["code"], body["error"]["layer"]) == ("workload.not_up", "workload")


def test_a_watch_ends_with_the_current_state_when_the_wait_is_over(api: tuple[CubeMaster, TestClient]) -> None:
    _, client = api
    t0 = time.monotonic()
    r = client.get("/v1/sandboxes/sb-w", params={"wait": 0.5})
    assert r.status_code == 200 and r.json()["state"] == "starting"
    assert time.monotonic() - t0 >= 0.5
    assert client.get("/v1/sandboxes/sb-w", params={"wait": 601}).status_code == 422
    assert client.post("/v1/sandboxes", params={"wait": -1}, json={"gpu": "H100:1"}).status_code == 422


def test_the_events_route_says_when_the_node_did_not_answer(api: tuple[CubeMaster, TestClient]) -> None:
    _, client = api
    r = client.get("/v1/sandboxes/sb-w/events")
    assert r.status_code == 200, r.text
    assert r.json() == {"v": 1, "sandbox_id": "sb-w", "state": "starting", "phases": [], "node_answered": False}
