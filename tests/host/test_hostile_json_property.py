"""Issue 19: any JSON value — non-finite numbers, huge integers, deep nesting, duplicate keys — sent as a
guest report or an API body gives a 4xx and changes nothing, never a 5xx. Both servers, in process."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cubeaccel.cubelet.server import create_app as cubelet_app
from cubeaccel.master.server import create_app as master_app
from cubeaccel.master.service import CubeMaster, MasterConfig
from cubeaccel.master.store import MasterStore
from tests.support.cubelet_harness import Node

numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(10**300), max_value=10**300),
    st.sampled_from([float("nan"), float("inf"), -float("inf"), 2**63, -(2**63) - 1, 10**30]),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, st.text(max_size=20))
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)),
    max_leaves=20,
)


def encode(v: Any) -> bytes:
    return json.dumps(v, allow_nan=True).encode()  # NaN/Infinity as Python writes them: what a bad client sends


deep = st.integers(min_value=30, max_value=5000).map(lambda n: b"[" * n + b"]" * n)
dup_keys = st.text(max_size=8).map(
    lambda k: json.dumps({k: 1})[:-1].encode() + b", " + json.dumps(k).encode() + b": 2}"
)
# a well-formed reservation made ill-formed: a duplicated key, a byte-order mark, a non-finite count
valid_reservation = st.integers(0, 10**6).map(lambda i: f'{{"sandbox_id": "h-{i}", "count": 1'.encode())
near_valid = st.one_of(
    valid_reservation.map(lambda b: b + b', "count": 1}'),
    valid_reservation.map(lambda b: b"\xef\xbb\xbf" + b + b"}"),
    st.integers(0, 10**6).map(lambda i: f'{{"sandbox_id": "h-{i}", "count": 1e400}}'.encode()),
)
bodies = st.one_of(values.map(encode), deep, dup_keys, near_valid, st.binary(max_size=64))
hostile_numbers = st.sampled_from([float("nan"), float("inf"), -float("inf"), 2**63, -(2**63) - 1, 10**40])


def _with_hostile(pair: tuple[Any, Any, bool]) -> Any:
    value, bad, as_list = pair
    return [value, bad] if as_list else {"agent_version": bad, "kernel_release": "6.1", "x": value}


hostile_values = st.one_of(
    st.tuples(values, hostile_numbers, st.booleans()).map(_with_hostile),
    st.integers(min_value=33, max_value=400).map(lambda d: json.loads("[" * d + "]" * d)),
)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Node, TestClient, CubeMaster, TestClient]]:
    n = Node.create(tmp_path_factory.mktemp("cubelet"))
    cub = TestClient(cubelet_app(n.cubelet), raise_server_exceptions=False)
    assert cub.post("/v1/reservations", json={"sandbox_id": "sb", "count": 1, "start": True}).status_code == 201
    m = CubeMaster(MasterStore(str(tmp_path_factory.mktemp("master") / "m.db")), MasterConfig())
    yield n, cub, m, TestClient(master_app(m), raise_server_exceptions=False)
    m.store.close()


def _cubelet_state(n: Node) -> object:
    res = n.cubelet.store.reservations()
    return n.states(), [(r.sandbox_id, r.phase, r.checkpoint.to_json()) for r in res], len(n.cubelet.store.events())


def _master_state(m: CubeMaster) -> object:
    return [r.id for r in m.store.sandboxes()], [v.name for v in m.store.all_node_views()]


CUBELET_ROUTES = [("POST", "/v1/shim-reports"), ("POST", "/v1/reservations"), ("POST", "/v1/reservations/sb/start")]
MASTER_ROUTES = [("POST", "/v1/sandboxes"), ("PUT", "/v1/nodes/n1"), ("POST", "/v1/templates")]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies, route=st.sampled_from(CUBELET_ROUTES + MASTER_ROUTES))
def test_any_json_body_is_a_4xx_that_changes_nothing(
    servers: tuple[Node, TestClient, CubeMaster, TestClient], body: bytes, route: tuple[str, str]
) -> None:
    n, cub, m, mas = servers
    client = cub if route in CUBELET_ROUTES else mas
    before = (_cubelet_state(n), _master_state(m))
    r = client.request(route[0], route[1], content=body, headers={"content-type": "application/json"})
    if route[1] == "/v1/reservations/sb/start":  # takes no body: the edge still parses one strictly
        assert r.status_code < 500, r.text
    else:
        assert 400 <= r.status_code < 500, (r.status_code, r.text)
        assert set(r.json()["error"]) == {"code", "layer", "message", "details"}
    assert (_cubelet_state(n), _master_state(m)) == before


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=hostile_values, kind=st.sampled_from(["guest_validated", "guest_validation_failed", "vm_started"]))
def test_a_guest_report_holding_a_hostile_value_is_a_4xx_that_changes_nothing(
    servers: tuple[Node, TestClient, CubeMaster, TestClient], value: Any, kind: str
) -> None:
    """The guest's words inside a well-formed shim report for a running sandbox: a non-finite or 64-bit
    overflowing number, or nesting past the bound, anywhere in them."""
    n, cub, _, _ = servers
    res = n.cubelet.store.reservation("sb")
    assert res is not None
    body = {"sandbox_id": "sb", "kind": kind, "start_id": res.checkpoint.start_id, "details": {"report": value}}
    before = _cubelet_state(n)
    r = cub.post("/v1/shim-reports", content=encode(body), headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert _cubelet_state(n) == before
