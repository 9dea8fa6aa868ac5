"""Issue 30 #1: a tenant that names another tenant's sandbox id learns nothing — no part of the other's create
request (env vars, metadata), and not even that the id exists: the reply is the one a free id gets."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from cubeaccel.master.auth import TENANT
from cubeaccel.master.records import Quota, SandboxRow
from cubeaccel.master.server import create_app
from cubeaccel.master.service import CreateSpec, CubeMaster, MasterConfig
from cubeaccel.master.store import MasterStore
from cubeaccel.model.sandbox_states import SandboxActor as SA
from cubeaccel.model.sandbox_states import SandboxEvent as SE
from cubeaccel.wire.cubelet_api import Release
from tests.support.master_builders import sandbox_row
from tests.support.stored_rows import stored_state

SECRET = "sk-live-0123456789abcdef"
REQUEST = {"template": None, "accelerators": [{"alternatives": [{"class": "gpu", "count": 1}]}]}


class Stack:
    def __init__(self, tmp_path: Path) -> None:
        self.master = CubeMaster(MasterStore(str(tmp_path / "m.db")), MasterConfig(staleness_s=10.0))
        self.master.resolve = lambda spec: []  # type: ignore[method-assign]
        self.master._place = self.place  # type: ignore[method-assign]
        self.api = TestClient(create_app(self.master), raise_server_exceptions=False)
        auth = self.master.auth
        self.keys: dict[str, str] = {}
        for t in ("t1", "t2"):
            auth.create_tenant(t, Quota())
            self.keys[t] = auth.create_key(TENANT, t)[1]

    def place(self, sid: str, spec: CreateSpec, resolved: Any) -> SandboxRow:
        """Stands in for the Cubelet round trip: the record as placement leaves it."""
        store = self.master.store
        store.update_sandbox(sid, "scheduled", event=SE.CLAIM, by=SA.PLACEMENT, node="n1")
        store.update_sandbox(sid, "reserved", event=SE.STARTED, by=SA.PLACEMENT)
        row = self.master.store.sandbox(sid)
        assert row is not None
        return row

    def create(self, tenant: str, sid: str, **body: Any) -> Any:
        return self.api.post(
            "/v1/sandboxes",
            json={"id": sid, "gpu": "H100:1", **body},
            headers={"Authorization": f"Bearer {self.keys[tenant]}"},
        )


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    s = Stack(tmp_path)
    yield s
    s.master.store.close()


def t1_sandbox(stack: Stack, sid: str, state: str) -> None:
    request = {**REQUEST, "env_vars": {"OPENAI_API_KEY": SECRET}, "metadata": {"owner": "alice@t1"}}
    stack.master.store.insert_sandbox(sandbox_row(sid, time.time(), tenant="t1", state=state, request=request))


def shape(reply: Any, sid: str) -> tuple[int, str]:
    """The reply as the caller sees it, less the id it sent itself."""
    return reply.status_code, reply.text.replace(sid, "<id>")


@pytest.mark.parametrize("state", ["running", "deleted", "failed"])
def test_a_create_naming_another_tenants_id_answers_as_for_a_free_id(stack: Stack, state: str) -> None:
    taken = stack.master.auth.sandbox_prefix("t1") + "job-1"
    free = stack.master.auth.sandbox_prefix("t1") + "job-2"
    t1_sandbox(stack, taken, state)
    on_taken = stack.create("t2", taken, env_vars={"X": "1"})
    on_free = stack.create("t2", free, env_vars={"X": "1"})
    assert SECRET not in on_taken.text and "alice@t1" not in on_taken.text, on_taken.text
    assert on_taken.status_code >= 400
    assert shape(on_taken, taken) == shape(on_free, free)
    assert stack.master.store.sandbox(free) is None  # nothing was made in t1's namespace either
    # and the same for an id t1 could never have chosen (made by the server, or by an admin)
    legacy = "sb-0123456789abcdef"
    t1_sandbox(stack, legacy, state)
    unused = "sb-fedcba9876543210"
    assert shape(stack.create("t2", legacy), legacy) == shape(stack.create("t2", unused), unused)


def test_a_tenant_retrying_a_create_with_its_own_id_gets_its_sandbox(stack: Stack) -> None:
    sid = stack.master.auth.sandbox_prefix("t2") + "nightly"
    first = stack.create("t2", sid, env_vars={"X": "1"})
    again = stack.create("t2", sid, env_vars={"X": "1"})
    assert (first.status_code, again.status_code) == (201, 200), (first.text, again.text)
    assert first.json()["id"] == again.json()["id"] == sid
    other = stack.create("t2", sid, env_vars={"X": "2"})  # its own id with another request: its own conflict
    assert other.status_code == 409 and other.json()["error"]["code"] == "sandbox.conflict"


def test_whoami_tells_a_tenant_its_sandbox_id_prefix(stack: Stack) -> None:
    r = stack.api.get("/v1/whoami", headers={"Authorization": f"Bearer {stack.keys['t2']}"})
    assert r.json()["sandbox_id_prefix"] == stack.master.auth.sandbox_prefix("t2")
    assert stack.master.auth.sandbox_prefix("t1") != stack.master.auth.sandbox_prefix("t2")


class Node:
    """Stands in for the node's Cubelet: records each release; the sandbox's envd token works while the node
    holds its reservation (as the Cubelet's workload proxy rules)."""

    def __init__(self) -> None:
        self.held: set[str] = set()

    def release(self, sid: str) -> Release:
        self.held.discard(sid)
        return Release(sandbox_id=sid, released=True, reservation=None, devices=[])


def running(stack: Stack, node: Node, tenant: str, name: str) -> str:
    sid = stack.master.auth.sandbox_prefix(tenant) + name
    r = stack.create(tenant, sid)
    assert r.status_code == 201, r.text
    stack.master.store.update_sandbox(sid, "ready", event=SE.READY, by=SA.CUBELET)
    node.held.add(sid)
    return sid


def test_revoking_a_tenant_ends_its_sandboxes_and_their_tokens(stack: Stack) -> None:
    """Issue 30 #2: a revoked tenant's sandboxes are deleted through the ordinary release path (so the node
    drops them and their envd tokens with them); the admin can still see and delete them; another tenant's
    sandboxes are untouched."""
    node = Node()
    stack.master.node_url = lambda node: "http://node"  # type: ignore[method-assign]
    stack.master.client = lambda url: node  # type: ignore[assignment,method-assign,return-value]
    doomed = [running(stack, node, "t1", "a"), running(stack, node, "t1", "b")]
    kept = running(stack, node, "t2", "c")
    admin = {"Authorization": f"Bearer {stack.master.auth.create_key('admin')[1]}"}
    assert stack.api.delete("/v1/tenants/t1", headers=admin).status_code == 200
    for sid in doomed:
        assert stored_state(stack.master.store, sid) == "deleted"
        assert sid not in node.held  # the node released it: its envd token reaches nothing
        r = stack.api.delete(f"/v1/sandboxes/{sid}", headers=admin)
        assert (r.status_code, r.json()["state"]) == (202, "deleted")
    assert stored_state(stack.master.store, kept) == "running" and kept in node.held
    # a create racing the revoke that lands after it is ended by the next maintenance pass
    late = stack.master.auth.sandbox_prefix("t1") + "late"
    stack.master.store.insert_sandbox(sandbox_row(late, time.time(), tenant="t1", state="running", node="n1"))
    node.held.add(late)
    from cubeaccel.master.maintenance import Maintenance

    Maintenance(stack.master).tick()
    assert stored_state(stack.master.store, late) == "deleted" and late not in node.held
    r = stack.api.post("/v1/sandboxes", json={"gpu": "H100:1", "tenant": "t1"}, headers=admin)
    assert (r.status_code, r.json()["error"]["code"]) == (404, "tenant.not_found")  # nothing new for it either
