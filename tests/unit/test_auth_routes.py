"""Every CubeMaster route x every kind of caller: the expected status, and no state change for a refusal.

The table below is written by hand (it is the access rule, said independently of the server's POLICY); the
cases are generated from the app's route list, so a route added without a row here fails
`test_every_route_has_a_row`.
"""

from __future__ import annotations

import hashlib
import json
import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from cubeaccel.host.service.audit import verify
from cubeaccel.master import schema as S
from cubeaccel.master.auth import ADMIN, SEAL_PREFIX, TENANT, key_id_of
from cubeaccel.master.records import Quota
from cubeaccel.master.server import create_app
from cubeaccel.master.service import CubeMaster, MasterConfig
from cubeaccel.master.store import MasterStore
from cubeaccel.transport.node_sig import NodeAuth, sign
from tests.support.master_builders import group, heartbeat, sandbox_row

URL = "http://127.0.0.1:9"
CALLERS = ("none", "wrong_key", "other_tenant", "tenant", "admin", "node")
T, A, N = frozenset({"tenant", "other_tenant"}), frozenset({"admin"}), frozenset({"node"})
ANY = frozenset(CALLERS)
AUTHED = ANY - {"none", "wrong_key"}

# (method, path) → who may call it. "other_tenant" on a route naming tenant t1's sandbox gets 404, not 403.
ALLOWED: dict[tuple[str, str], frozenset[str]] = {
    ("GET", "/v1/health"): ANY,
    ("GET", "/v1/whoami"): AUTHED,
    ("PUT", "/v1/nodes/{node}"): N,
    ("PUT", "/v1/nodes/{node}/sandboxes/{sandbox_id}/status"): N,
    ("GET", "/v1/nodes"): A,
    ("GET", "/v1/nodes/{node}"): A,
    ("POST", "/v1/nodes/{node}/{verb}"): A,
    ("GET", "/v1/nodes/{node}/devices"): A,
    ("POST", "/v1/nodes/{node}/devices/{device_id}/{verb}"): A,
    ("POST", "/v1/nodes/{node}/credential"): A,
    ("DELETE", "/v1/nodes/{node}/credential"): A,
    ("GET", "/v1/capacity"): T | A,
    ("POST", "/v1/templates"): A,
    ("GET", "/v1/templates"): T | A,
    ("GET", "/v1/templates/{ref}"): T | A,
    ("DELETE", "/v1/templates/{ref}"): A,
    ("PUT", "/v1/template-defaults/{accel_class}"): A,
    ("POST", "/v1/sandboxes"): T | A,
    ("GET", "/v1/sandboxes"): T | A,
    ("GET", "/v1/sandboxes/{sandbox_id}"): T | A,
    ("DELETE", "/v1/sandboxes/{sandbox_id}"): T | A,
    ("POST", "/v1/sandboxes/{sandbox_id}/timeout"): T | A,
    ("PUT", "/v1/sandboxes/{sandbox_id}/network"): T | A,
    ("GET", "/v1/sandboxes/{sandbox_id}/events"): T | A,
    ("GET", "/v1/sandboxes/{sandbox_id}/workload"): T | A,  # the tenant CLI's way to exec and cp
    ("POST", "/v1/sandboxes/{sandbox_id}/connect"): T | A,  # and the sandbox's token, for its owner
    ("POST", "/v1/tenants"): A,
    ("GET", "/v1/tenants"): A,
    ("DELETE", "/v1/tenants/{tenant}"): A,
    ("POST", "/v1/tenants/{tenant}/keys"): A,
    ("POST", "/v1/admin-keys"): A,
    ("POST", "/v1/keys"): T | A,
    ("GET", "/v1/keys"): T | A,
    ("DELETE", "/v1/keys/{key_id}"): T | A,
    ("GET", "/v1/audit/seals"): A,
    ("GET", "/metrics"): A,
    ("GET", "/dashboard"): ANY,  # the static page; its data is admins'
    ("GET", "/v1/dashboard"): A,
}
# routes naming t1's sandbox or t1's spare key: other tenants see a 404
OWNED = {
    "/v1/sandboxes/{sandbox_id}",
    "/v1/sandboxes/{sandbox_id}/timeout",
    "/v1/sandboxes/{sandbox_id}/network",
    "/v1/sandboxes/{sandbox_id}/events",
    "/v1/sandboxes/{sandbox_id}/workload",
    "/v1/sandboxes/{sandbox_id}/connect",
    "/v1/keys/{key_id}",
}
PARAMS = {
    "node": "n1",
    "sandbox_id": "sb-t1",
    "ref": "nope",
    "accel_class": "gpu",
    "verb": "drain",
    "tenant": "t9",
    "key_id": "<t1's spare key>",
    "device_id": "simulated-0000:3b:00.0",
}
BODIES: dict[tuple[str, str], Any] = {
    ("PUT", "/v1/nodes/{node}"): heartbeat("n1", group("H100-PCIe-80GB", 2), url=URL),
    ("PUT", "/v1/nodes/{node}/sandboxes/{sandbox_id}/status"): {"phase": "running"},
    ("POST", "/v1/nodes/{node}/{verb}"): {},
    ("POST", "/v1/nodes/{node}/devices/{device_id}/{verb}"): {"reason": "suspect"},
    ("POST", "/v1/templates"): {},
    ("PUT", "/v1/template-defaults/{accel_class}"): {"template": "nope"},
    ("POST", "/v1/sandboxes"): {"gpu": "H100:1"},
    ("POST", "/v1/sandboxes/{sandbox_id}/timeout"): {"timeout_s": 60},
    ("PUT", "/v1/sandboxes/{sandbox_id}/network"): {"network": {"allow_out": [], "deny_out": []}},
    ("POST", "/v1/tenants"): {"name": "t9"},
}


def api_routes(routes: list[Any]) -> Iterator[APIRoute]:
    """Every route the app serves. The routers are included whole: an older FastAPI copies their routes into the
    app's list, a newer one keeps each router as one entry holding its own (`original_router`)."""
    for r in routes:
        if isinstance(r, APIRoute):
            yield r
        inner = getattr(r, "original_router", None)
        if inner is not None:
            yield from api_routes(inner.routes)


def routes() -> list[tuple[str, str]]:
    with tempfile.TemporaryDirectory() as d:
        store = MasterStore(str(Path(d) / "m.db"))
        app = create_app(CubeMaster(store))
        store.close()
    return sorted((m, r.path) for r in api_routes(app.routes) for m in r.methods or () if r.path != "/openapi.json")


class World:
    def __init__(self, tmp_path: Path) -> None:
        self.master = CubeMaster(MasterStore(str(tmp_path / "m.db")), MasterConfig(staleness_s=10.0))
        self.audit = tmp_path / "audit.jsonl"
        self.api = TestClient(create_app(self.master, audit=self.audit), raise_server_exceptions=False)
        auth = self.master.auth
        for t in ("t1", "t2"):
            auth.create_tenant(t, Quota())
        _, admin = auth.create_key(ADMIN)
        _, t1 = auth.create_key(TENANT, "t1")
        _, t2 = auth.create_key(TENANT, "t2")
        self.params = {**PARAMS, "key_id": auth.create_key(TENANT, "t1")[0]}
        self.keys: dict[str, str] = {  # and the caller "none", with no key
            "wrong_key": t1[:-4] + ("aaaa" if not t1.endswith("aaaa") else "bbbb"),  # t1's id, a wrong secret
            "tenant": t1,
            "other_tenant": t2,
            "admin": admin,
            "node": auth.enrol_node("n1"),
        }
        self.master.store.heartbeat(heartbeat("n1", group("H100-PCIe-80GB", 2), url=URL), time.time(), 10.0)
        now = time.time()
        self.master.store.insert_sandbox(sandbox_row("sb-t1", now, tenant="t1", state="failed"))

    def call(self, caller: str, method: str, path: str) -> Any:
        key = None if caller == "none" else self.keys[caller]
        node = caller == "node"  # a node signs each request with its token (never sends it)
        headers = {"Authorization": f"Bearer {key}"} if key and not node else {}
        url = path.format(**self.params)
        body = BODIES.get((method, path))
        return self.api.request(method, url, headers=headers, json=body, auth=NodeAuth(key) if node and key else None)

    def snapshot(self) -> str:
        """Every table, less the audit log's seal (a refusal is audited, so its head moves)."""
        out = {}
        with self.master.store.tx() as c:
            for t in S.metadata.sorted_tables:
                rows = [dict(r._mapping) for r in c.execute(sa.select(t))]
                out[t.name] = [r for r in rows if not str(r.get("key", "")).startswith(SEAL_PREFIX)]
        return json.dumps(out, sort_keys=True, default=str)


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    w = World(tmp_path)
    yield w
    w.master.store.close()


def test_every_route_has_a_row() -> None:
    assert set(routes()) == set(ALLOWED), "a route without an access row (add it to ALLOWED and to POLICY)"


def expected(method: str, path: str, caller: str) -> int | None:
    """The refusal status for `caller`, or None when the call is allowed (any non-auth outcome then)."""
    allowed = ALLOWED[(method, path)]
    if caller in ("none", "wrong_key") and caller not in allowed:
        return 401
    if caller == "other_tenant" and path in OWNED and caller in allowed:
        return 404
    return None if caller in allowed else 403


@pytest.mark.parametrize(("method", "path"), routes())
def test_route_by_caller(world: World, method: str, path: str) -> None:
    # refusals first (each must leave the database exactly as it was), then the allowed calls
    order = sorted(CALLERS, key=lambda c: expected(method, path, c) is None)
    for caller in order:
        status = expected(method, path, caller)
        before = world.snapshot()
        r = world.call(caller, method, path)
        if status is None:
            assert r.status_code not in (401, 403), (caller, r.status_code, r.text)
            continue
        assert r.status_code == status, (caller, r.status_code, r.text)
        assert world.snapshot() == before, f"{caller} was refused but the state changed"
        if status in (401, 403):
            assert r.json()["error"]["code"].startswith("auth."), r.text
            logged = [json.loads(x) for x in world.audit.read_text().splitlines()]
            assert logged[-1]["status"] == status and logged[-1]["outcome"] == "refused"
    assert verify(world.audit) == []


def put_signed(world: World, path: str, body: Any, token: str, **over: Any) -> Any:
    """A heartbeat signed the way a Cubelet signs it (`over`: headers to tamper with)."""
    raw = json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **sign(token, "PUT", path, raw), **over}
    return world.api.put(path, content=raw, headers=headers)


def test_a_forged_registration_and_a_heartbeat_signed_as_another_node_are_refused(world: World) -> None:
    hb = heartbeat("n2", group("H100-PCIe-80GB", 2), url=URL)
    r = put_signed(world, "/v1/nodes/n2", hb, world.keys["node"])  # n1's token, acting as n2
    assert (r.status_code, r.json()["error"]["code"]) == (403, "auth.wrong_node")
    forged = "cbn:n2:1:" + "0" * 64  # a node never enrolled, with a made-up token
    r = put_signed(world, "/v1/nodes/n2", hb, forged)
    assert (r.status_code, r.json()["error"]["code"]) == (401, "auth.invalid_credential")
    guessed = world.master.auth.enrol_node("n2")[:-4] + "0000"  # enrolled, but not its token
    assert put_signed(world, "/v1/nodes/n2", hb, guessed).status_code == 401
    assert world.master.store.sandbox("sb-t1") is not None
    assert [v.name for v in world.master.store.all_node_views()] == ["n1"]


def test_a_replayed_stale_tampered_or_bearer_node_request_is_refused(world: World) -> None:
    token, path = world.keys["node"], "/v1/nodes/n1"
    body = heartbeat("n1", group("H100-PCIe-80GB", 3), url=URL)
    raw = json.dumps(body).encode()
    captured = {"Content-Type": "application/json", **sign(token, "PUT", path, raw)}
    assert world.api.put(path, content=raw, headers=captured).status_code == 200
    before = world.snapshot()
    r = world.api.put(path, content=raw, headers=captured)  # the same request again
    assert (r.status_code, r.json()["error"]["code"]) == (401, "auth.invalid_credential"), r.text
    assert "replay" in r.json()["error"]["message"]
    other = json.dumps(heartbeat("n1", group("H100-PCIe-80GB", 0), url=URL)).encode()
    assert world.api.put(path, content=other, headers={**captured, **sign(token, "PUT", path, raw)}).status_code == 401
    stale = sign(token, "PUT", path, raw, at=time.time() - 3600)
    assert world.api.put(path, content=raw, headers={"Content-Type": "application/json", **stale}).status_code == 401
    bearer = {"Authorization": f"Bearer {token}"}  # the token itself is no credential: nodes never send it
    assert world.api.put(path, json=body, headers=bearer).status_code == 401
    assert world.snapshot() == before


def test_a_replaced_or_revoked_node_token_is_refused(world: World) -> None:
    body, path = heartbeat("n1", group("H100-PCIe-80GB", 2), url=URL), "/v1/nodes/n1"
    old = world.keys["node"]
    new = world.master.auth.enrol_node("n1")  # re-enrolment: the earlier token stops working
    assert put_signed(world, path, body, old).status_code == 401
    assert put_signed(world, path, body, new).status_code == 200
    world.master.auth.revoke_node("n1")
    r = put_signed(world, path, body, new)
    assert (r.status_code, r.json()["error"]["code"]) == (401, "auth.invalid_credential")


def test_a_tenant_lists_only_its_own_sandboxes_and_a_revoked_key_stops_working(world: World) -> None:
    def ids(caller: str) -> list[str]:
        return [s["id"] for s in world.call(caller, "GET", "/v1/sandboxes").json()["sandboxes"]]

    assert ids("tenant") == ["sb-t1"] and ids("other_tenant") == [] and ids("admin") == ["sb-t1"]
    kid = key_id_of(world.keys["tenant"])
    assert world.call("admin", "DELETE", f"/v1/keys/{kid}").status_code == 200
    assert world.call("tenant", "GET", "/v1/sandboxes").status_code == 401


def test_repeated_failures_of_one_credential_are_throttled_and_its_valid_key_still_works(world: World) -> None:
    # `wrong_key` is t1's key id with a wrong secret: that presented credential is throttled...
    for _ in range(world.master.auth.throttle.limit):
        assert world.call("wrong_key", "GET", "/v1/sandboxes").status_code == 401
    r = world.call("wrong_key", "GET", "/v1/sandboxes")
    assert (r.status_code, r.json()["error"]["code"]) == (429, "auth.throttled")
    # ...and t1's real key, with the same id, from the same address, is still recognised (issue 30 #3)
    assert world.call("tenant", "GET", "/v1/sandboxes").status_code == 200
    assert world.keys["wrong_key"] not in world.audit.read_text() and world.keys["tenant"] not in r.text


def test_made_up_keys_from_the_shared_address_lock_out_no_one(world: World) -> None:
    """Issue 30 #3: the front door and the nodes reach CubeMaster from one address; a flood of made-up keys
    (each a new key id, or garbage) through it must not lock out tenants, the front door's admin lookups, or
    the nodes' heartbeats."""
    limit = world.master.auth.throttle.limit
    made_up = [f"cbk_{i:08x}_{'x' * 43}" for i in range(limit + 5)] + ["garbage"] * (limit + 5)
    for key in made_up:
        r = world.api.get("/v1/sandboxes", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code in (401, 429), r.text
    assert world.call("tenant", "GET", "/v1/sandboxes").status_code == 200
    assert world.call("other_tenant", "GET", "/v1/sandboxes").status_code == 200
    assert world.call("admin", "GET", "/v1/sandboxes/sb-t1").status_code == 200  # the front door's lookup
    beat = heartbeat("n1", group("H100-PCIe-80GB", 2), url=URL)
    assert put_signed(world, "/v1/nodes/n1", beat, world.keys["node"]).status_code == 200


def test_the_database_holding_the_node_secret_is_owner_only(tmp_path: Path) -> None:
    MasterStore(str(tmp_path / "fresh.db")).close()
    assert (tmp_path / "fresh.db").stat().st_mode & 0o777 == 0o600


def test_a_tenant_rotates_its_own_key_without_downtime(world: World) -> None:
    old = {"Authorization": f"Bearer {world.keys['tenant']}"}
    made = world.api.post("/v1/keys", headers=old)
    assert made.status_code == 201 and made.json()["tenant"] == "t1"
    new = {"Authorization": f"Bearer {made.json()['key']}"}
    for h in (old, new):  # both work until the old one is revoked: no gap for clients switching over
        assert [s["id"] for s in world.api.get("/v1/sandboxes", headers=h).json()["sandboxes"]] == ["sb-t1"]
    listed = world.api.get("/v1/keys", headers=new).json()["keys"]
    assert {k["tenant"] for k in listed} == {"t1"} and made.json()["key_id"] in {k["key_id"] for k in listed}
    assert all(k["tenant"] == "t2" for k in world.call("other_tenant", "GET", "/v1/keys").json()["keys"])
    old_id = key_id_of(world.keys["tenant"])
    assert world.api.delete(f"/v1/keys/{old_id}", headers=new).status_code == 200
    assert world.api.get("/v1/sandboxes", headers=old).status_code == 401
    assert world.api.get("/v1/sandboxes", headers=new).status_code == 200
    admin_key = key_id_of(world.keys["admin"])  # a tenant cannot revoke a key not its own: 404, nothing changes
    r = world.api.delete(f"/v1/keys/{admin_key}", headers=new)
    assert (r.status_code, r.json()["error"]["code"]) == (404, "key.not_found")
    assert world.call("admin", "GET", "/v1/whoami").status_code == 200


def tenant_views() -> list[tuple[str, str]]:
    return [(m, p) for m, p in routes() if m == "GET" and "other_tenant" in ALLOWED[(m, p)]]


@pytest.mark.parametrize(("method", "path"), tenant_views())
def test_no_tenant_facing_view_shows_another_tenants_sandbox_ids(world: World, method: str, path: str) -> None:
    """Generated from the route list: a view added later (events, devices, watch) is checked too. t1's id
    shows only where t2 typed it into the path itself (and that is a 404)."""
    world.master.store.insert_sandbox(sandbox_row("sb-t1-running", time.time(), tenant="t1", state="running"))
    r = world.call("other_tenant", method, path)
    url = path.format(**world.params)
    for sid in ("sb-t1", "sb-t1-running"):
        if sid not in url:
            assert sid not in r.text, (path, r.text[:500])
    assert "sb-t1-running" in world.call("tenant", "GET", "/v1/sandboxes").text  # the check can fail


SDK_KEY_RE = re.compile(r"\Ae2b_[0-9a-f]+\Z")  # e2b 2.25.0-2.45.1 refuse any other key before sending (issue 29)


def test_keys_have_the_shape_every_e2b_sdk_line_accepts_and_old_keys_keep_working(world: World) -> None:
    made = world.api.post("/v1/keys", headers={"Authorization": f"Bearer {world.keys['tenant']}"}).json()
    for key in (world.keys["tenant"], world.keys["admin"], made["key"]):
        assert SDK_KEY_RE.match(key) and len(key) == 4 + 8 + 64, key
        assert key_id_of(key) == key[4:12]
    assert key_id_of(made["key"]) == made["key_id"]
    old = "cbk_0ld1d001_" + "s3cret-" * 6  # a key in the shape made before issue 29, stored as those were
    with world.master.store.tx() as c:
        c.execute(
            S.api_keys.insert().values(
                id="0ld1d001", digest=hashlib.sha256(old.encode()).hexdigest(), role=TENANT, tenant="t1", created_at=1.0
            )
        )
    r = world.api.get("/v1/whoami", headers={"Authorization": f"Bearer {old}"})
    assert (r.status_code, r.json()["tenant"], r.json()["key_id"]) == (200, "t1", "0ld1d001")
    assert world.api.get("/v1/whoami", headers={"Authorization": f"Bearer {old[:-1]}x"}).status_code == 401
