"""Tenant isolation as a property (issue 30): two tenants run random sequences of create, get, list, delete, exec
and revoke through CubeMaster and the E2B front door (real processes, the simulated shim driver); no reply to one
tenant carries anything of the other's (its name, key, sandbox ids, metadata or env values), and another tenant's
sandbox looks exactly like an id nobody uses.
"""

from __future__ import annotations

import contextlib
import itertools
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cubeaccel.protocol.errors import CubeError
from tests.support.frontdoor_process import FrontDoorProcess
from tests.support.master_harness import Cluster
from tests.support.poll import poll

NODE = "iso-n1"
OPS = ("create", "get_own", "get_other", "list", "delete_own", "delete_other", "exec_other", "revoke")
SEQ = itertools.count()


@dataclass
class Tenant:
    name: str
    key: str
    marker: str  # in its metadata and its env vars: must never reach the other tenant
    ids: list[str] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)

    def secrets(self) -> list[str]:
        return [self.name, self.key, self.marker, *self.ids]


@dataclass
class Stack:
    cluster: Cluster
    fd: FrontDoorProcess
    http: httpx.Client


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root: Path = tmp_path_factory.mktemp("isolation")
    cl = Cluster(root, {NODE: "h100x8"})
    fd = FrontDoorProcess(root / "fd", cl.master.url, cl.master.admin_key).start()
    try:
        with httpx.Client(timeout=60) as http:
            yield Stack(cl, fd, http)
    finally:
        fd.stop()
        cl.stop()


def _tenant(s: Stack, tag: str) -> Tenant:
    name = f"iso{next(SEQ)}{tag}{uuid.uuid4().hex[:6]}"
    key = s.cluster.c.request("POST", "/v1/tenants", {"name": name})["key"]
    return Tenant(name, key, f"secret-{uuid.uuid4().hex}")


def _call(s: Stack, via: str, who: Tenant, method: str, path: str, **kw: object) -> httpx.Response:
    base = s.cluster.master.url if via == "master" else s.fd.url
    auth = {"Authorization": f"Bearer {who.key}"} if via == "master" else {"X-API-Key": who.key}
    headers = {**auth, **kw.pop("headers", {})}  # type: ignore[dict-item]
    return s.http.request(method, base + path, headers=headers, **kw)  # type: ignore[arg-type]


def _free_like(sid: str) -> str:
    """An id of the same shape in the same namespace that nobody uses."""
    return sid[:-16] + uuid.uuid4().hex[:16]


def _step(s: Stack, me: Tenant, other: Tenant, op: str, via: str, pick: int) -> list[httpx.Response]:
    theirs = other.ids[pick % len(other.ids)] if other.ids else None
    if op == "create":
        if via == "master":
            body = {"gpu": "H100:1", "metadata": {"m": me.marker}, "env_vars": {"E": me.marker}, "timeout_s": 120}
            r = _call(s, via, me, "POST", "/v1/sandboxes", json=body)
            if r.status_code in (200, 201):
                me.ids.append(r.json()["id"])
        else:
            body = {"templateID": "cuda12-h100", "metadata": {"m": me.marker}, "envVars": {"E": me.marker}}
            r = _call(s, via, me, "POST", "/sandboxes", json={**body, "timeout": 120})
            if r.status_code == 201:
                me.ids.append(r.json()["sandboxID"])
                me.tokens.append(r.json()["envdAccessToken"])
        return [r]
    if op == "list":
        return [_call(s, via, me, "GET", "/v1/sandboxes" if via == "master" else "/v2/sandboxes")]
    if op == "get_own" and me.ids:
        return [_call(s, via, me, "GET", f"/{'v1/' if via == 'master' else ''}sandboxes/{me.ids[pick % len(me.ids)]}")]
    if op in ("get_other", "delete_other") and theirs is not None:
        method = "GET" if op == "get_other" else "DELETE"
        prefix = "/v1/sandboxes/" if via == "master" else "/sandboxes/"
        r, free = (_call(s, via, me, method, prefix + sid) for sid in (theirs, _free_like(theirs)))
        assert r.status_code == free.status_code, (r.text, free.text)  # the same answer as for a free id
        assert r.text.replace(theirs, "ID") == free.text.replace(free.request.url.path.rsplit("/", 1)[1], "ID")
        return [r]
    if op == "delete_own" and me.ids:
        path = f"/{'v1/' if via == 'master' else ''}sandboxes/{me.ids[pick % len(me.ids)]}"
        return [_call(s, via, me, "DELETE", path)]
    if op == "exec_other" and theirs is not None:
        headers = {"E2b-Sandbox-Id": theirs, "X-Access-Token": me.tokens[-1] if me.tokens else "none"}
        body = {"process": {"cmd": "/bin/cat", "args": ["/proc/self/environ"]}}
        return [_call(s, "fd", me, "POST", "/process.Process/Start", json=body, headers=headers)]
    if op == "revoke":
        with contextlib.suppress(CubeError):  # revoked already
            s.cluster.c.request("DELETE", f"/v1/tenants/{me.name}")
        return [_call(s, via, me, "GET", "/v1/sandboxes" if via == "master" else "/v2/sandboxes")]
    return []


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.tuples(st.sampled_from("ab"), st.sampled_from(OPS), st.sampled_from(("master", "fd")), st.integers(0, 7)),
        min_size=4,
        max_size=10,
    )
)
def test_no_reply_to_one_tenant_carries_the_others(stack: Stack, steps: list[tuple[str, str, str, int]]) -> None:
    a, b = _tenant(stack, "a"), _tenant(stack, "b")
    # Each tenant first has a sandbox, so every sequence can reach the other's.
    for t in (a, b):
        _step(stack, t, a if t is b else b, "create", "fd", 0)
    try:
        for who, op, via, pick in steps:
            me, other = (a, b) if who == "a" else (b, a)
            for r in _step(stack, me, other, op, via, pick):
                sent = r.request.url.path.rsplit("/", 1)[-1]  # an id the caller named itself may be echoed
                leaked = [x for x in other.secrets() if x != sent and x in r.text]
                assert not leaked, f"{op} via {via} by {me.name}: {r.status_code} {r.text[:300]} carries {leaked}"
    finally:
        for t in (a, b):
            with contextlib.suppress(CubeError):  # revoked already by a step
                stack.cluster.c.request("DELETE", f"/v1/tenants/{t.name}")  # its sandboxes end with it
        poll(lambda: all(n.allocatable == n.total for n in stack.cluster.c.nodes()), 60, what="devices back")
