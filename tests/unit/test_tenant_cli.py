"""A tenant's own CLI, with nothing but its API key: `sandbox create` creates for the key's tenant without
`--tenant`, and `sandbox exec`/`cp` obtain the sandbox's access token themselves (the owner's key is enough, as
E2B's connect gives it to the owner). The CLI runs in-process against CubeMaster's real app; placement and the
node's workload proxy are stand-ins."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from cubeaccel.cli import master_access
from cubeaccel.cli.sandbox import sandbox_app
from cubeaccel.master.auth import ADMIN, TENANT
from cubeaccel.master.records import Quota, SandboxRow
from cubeaccel.master.server import create_app
from cubeaccel.master.service import CreateSpec, CubeMaster, MasterConfig
from cubeaccel.master.store import MasterStore
from cubeaccel.model.sandbox_states import SandboxActor as SA
from cubeaccel.model.sandbox_states import SandboxEvent as SE
from cubeaccel.transport import workload_client
from cubeaccel.transport.master_client import MasterClient

NODE_URL = "http://node-1.test:7701"


class Stack:
    """CubeMaster's app with placement standing in for the Cubelet: a create is `running` on node-1 at once."""

    def __init__(self, tmp_path: Path) -> None:
        self.master = CubeMaster(MasterStore(str(tmp_path / "m.db")), MasterConfig(staleness_s=10.0))
        self.master.resolve = lambda spec: []  # type: ignore[method-assign]
        self.master._place = self.place  # type: ignore[method-assign]
        self.master.node_url = lambda node: NODE_URL if node == "node-1" else None  # type: ignore[method-assign]
        self.app = create_app(self.master)
        auth = self.master.auth
        self.keys: dict[str, str] = {"admin": auth.create_key(ADMIN)[1]}
        for t in ("acme", "globex"):
            auth.create_tenant(t, Quota())
            self.keys[t] = auth.create_key(TENANT, t)[1]
        self.specs: list[CreateSpec] = []

    def place(self, sid: str, spec: CreateSpec, resolved: Any) -> SandboxRow:
        self.specs.append(spec)
        if spec.workload_token is not None:  # the node starts it with the token given and says it once
            self.master.issued_tokens[sid] = spec.workload_token
        store = self.master.store
        store.update_sandbox(sid, "scheduled", event=SE.CLAIM, by=SA.PLACEMENT, node="node-1")
        store.update_sandbox(sid, "reserved", event=SE.READY, by=SA.PLACEMENT)
        row = store.sandbox(sid)
        assert row is not None
        return row

    def client(self, url: str, timeout: float = 60.0, key: str | None = None) -> MasterClient:
        """What the CLI's `call_master` builds, talking to the app in-process."""
        c = MasterClient(url, timeout, key)
        c._http.close()
        c._http = TestClient(self.app, headers={"Authorization": f"Bearer {key}"} if key else None)
        return c


@pytest.fixture
def stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Stack]:
    s = Stack(tmp_path)
    monkeypatch.setattr(master_access, "MasterClient", s.client)
    for var in ("CUBEACCEL_API_KEY", "CUBEACCEL_SANDBOX_TOKEN", "CUBEACCEL_MASTER"):
        monkeypatch.delenv(var, raising=False)
    yield s
    s.master.store.close()


def cli(stack: Stack, who: str, *argv: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """The CLI as a tenant runs it: its key in a file named by $CUBEACCEL_API_KEY_FILE."""
    key_file = tmp_path / f"{who}.key"
    key_file.write_text(stack.keys[who] + "\n")
    monkeypatch.setenv("CUBEACCEL_API_KEY_FILE", str(key_file))
    command, *rest = argv
    return CliRunner().invoke(sandbox_app, [command, "--master", "http://master.test", *rest], input="")


def test_a_tenant_key_creates_for_its_own_tenant_without_naming_it(
    stack: Stack, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    r = cli(
        stack, "acme", "create", "--gpu", "H100:1", "--no-wait", "--json", monkeypatch=monkeypatch, tmp_path=tmp_path
    )
    assert r.exit_code == 0, r.output
    created = json.loads(r.output)
    assert created["tenant"] == "acme" and created["state"] == "running"
    assert [s.tenant for s in stack.specs] == ["acme"]


def test_a_tenant_key_naming_another_tenant_is_still_refused(
    stack: Stack, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    argv = ("create", "--gpu", "H100:1", "--tenant", "globex", "--no-wait", "--json")
    r = cli(stack, "acme", *argv, monkeypatch=monkeypatch, tmp_path=tmp_path)
    assert r.exit_code == 1 and "auth.forbidden" in r.output
    assert stack.specs == []


def test_an_admin_key_without_tenant_creates_for_default_and_with_one_for_it(
    stack: Stack, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    stack.master.auth.create_tenant("default", Quota())
    for argv, tenant in ((), "default"), (("--tenant", "globex"), "globex"):
        r = cli(
            stack,
            "admin",
            "create",
            "--gpu",
            "H100:1",
            *argv,
            "--no-wait",
            "--json",
            monkeypatch=monkeypatch,
            tmp_path=tmp_path,
        )
        assert r.exit_code == 0, r.output
        assert json.loads(r.output)["tenant"] == tenant


class Ran:
    exit_code = 0


class NodeProxy:
    """The sandbox's node's workload proxy as the CLI reaches it: records the endpoint and token each client got."""

    def __init__(self) -> None:
        self.clients: list[tuple[str, str]] = []
        self.ran: list[list[str]] = []
        self.files: dict[str, bytes] = {}

    def over(self, url: str, token: str, timeout: float | None = None) -> NodeProxy:
        self.clients.append((url, token))
        return self

    def exec(self, cmd: list[str], **kw: Any) -> Ran:
        self.ran.append(cmd)
        return Ran()

    def upload(self, path: str, f: Any, user: str | None = None) -> None:
        self.files[path] = f.read()

    def close(self) -> None:
        pass


@pytest.fixture
def node(monkeypatch: pytest.MonkeyPatch) -> NodeProxy:
    proxy = NodeProxy()
    monkeypatch.setattr(workload_client.WorkloadClient, "over", proxy.over)
    return proxy


def created(stack: Stack, who: str, **body: Any) -> dict[str, Any]:
    r = TestClient(stack.app).post(
        "/v1/sandboxes", json={"gpu": "H100:1", **body}, headers={"Authorization": f"Bearer {stack.keys[who]}"}
    )
    assert r.status_code == 201, r.text
    out: dict[str, Any] = r.json()
    return out


def test_exec_with_only_the_tenants_key_obtains_the_sandboxs_token_itself(
    stack: Stack, node: NodeProxy, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    sb = created(stack, "acme")
    r = cli(
        stack, "acme", "exec", sb["id"], "--no-stdin", "--", "nvidia-smi", monkeypatch=monkeypatch, tmp_path=tmp_path
    )
    assert r.exit_code == 0, r.output
    endpoint = f"{NODE_URL}/v1/sandboxes/{sb['id']}/workload"
    assert node.clients == [(endpoint, sb["access_token"])] and node.ran == [["nvidia-smi"]]


def test_connect_gives_the_same_token_every_time_and_only_to_the_owner(stack: Stack) -> None:
    sb = created(stack, "acme")
    api = TestClient(stack.app)
    for who in ("acme", "acme", "admin"):
        r = api.post(f"/v1/sandboxes/{sb['id']}/connect", headers={"Authorization": f"Bearer {stack.keys[who]}"})
        assert r.status_code == 200 and r.json()["access_token"] == sb["access_token"], r.text
    r = api.post(f"/v1/sandboxes/{sb['id']}/connect", headers={"Authorization": f"Bearer {stack.keys['globex']}"})
    assert (r.status_code, r.json()["error"]["code"]) == (404, "sandbox.not_found")


def test_two_sandboxes_get_different_tokens(stack: Stack) -> None:
    assert created(stack, "acme")["access_token"] != created(stack, "acme")["access_token"]


def test_a_token_the_creator_chose_is_not_handed_out_and_token_still_works(
    stack: Stack, node: NodeProxy, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The E2B front door derives its own token (it gives it on E2B's connect); CubeMaster cannot give it."""
    chosen = "f" * 43
    sb = created(stack, "acme", workload_token=chosen)
    r = cli(stack, "acme", "exec", sb["id"], "--", "true", monkeypatch=monkeypatch, tmp_path=tmp_path)
    assert r.exit_code == 1 and "workload.token_unavailable" in r.output and node.clients == []
    r = cli(
        stack, "acme", "exec", "--token", chosen, sb["id"], "--", "true", monkeypatch=monkeypatch, tmp_path=tmp_path
    )
    assert r.exit_code == 0, r.output
    assert node.clients == [(f"{NODE_URL}/v1/sandboxes/{sb['id']}/workload", chosen)]


def test_cp_with_only_the_tenants_key_obtains_the_token_too(
    stack: Stack, node: NodeProxy, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    sb = created(stack, "acme")
    (tmp_path / "in.txt").write_bytes(b"weights")
    r = cli(
        stack,
        "acme",
        "cp",
        str(tmp_path / "in.txt"),
        f"{sb['id']}:/data/in.txt",
        monkeypatch=monkeypatch,
        tmp_path=tmp_path,
    )
    assert r.exit_code == 0, r.output
    assert node.clients[0][1] == sb["access_token"] and node.files == {"/data/in.txt": b"weights"}
