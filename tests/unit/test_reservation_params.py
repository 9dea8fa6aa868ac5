"""The reservation's contract and params, typed from CubeMaster to the Cubelet's journal: the JSON on the wire and
in the journal is what the dict-based code wrote, rows it wrote read back, and a malformed contract keeps its code."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from cubeaccel.cubelet.lifecycle import ReservationRequest
from cubeaccel.cubelet.server import create_app
from cubeaccel.host.service.audit import AuditLog
from cubeaccel.model.contract import CompatibilityContract, freeze
from cubeaccel.model.reservation_params import CarriedContract, NetworkRequest, ReservationParams, parse_contract
from cubeaccel.model.reservation_states import ReservationPhase
from cubeaccel.protocol.errors import CubeError
from cubeaccel.transport.cubelet_client import _sent
from cubeaccel.wire import cubelet_api as W
from cubeaccel.wire.cubelet_api import ReservationBody
from cubeaccel.wire.templates import load_template
from tests.support.cubelet_harness import Node

EXAMPLES = Path(__file__).resolve().parents[2] / "src" / "cubeaccel" / "examples" / "templates"
H100 = freeze(load_template(EXAMPLES / "cuda12-h100.yaml"))
TOOL = freeze(load_template(EXAMPLES / "untrusted-tool-h100.yaml"))


def old_params(req: dict[str, Any]) -> dict[str, Any]:
    """The dict `ReservationRequest.params()` built before params were typed (the oracle)."""
    return {
        "count": req.get("count", 1),
        "class": req.get("class"),
        "labels": dict(req.get("labels", {})),
        "template": req.get("template"),
        "memory_mib": req.get("memory_mib", 512),
        "vcpus": req.get("vcpus", 1),
        "pin_memory": req.get("pin_memory", True),
        "contract": req.get("contract"),
        "lifetime_s": req.get("lifetime_s"),
        **({"network": req["network"]} if req.get("network") is not None else {}),
        **({"tenant": req["tenant"]} if req.get("tenant") is not None else {}),
    }


def stored(params: dict[str, Any]) -> str:
    return json.dumps(params, sort_keys=True)  # the journal's column, as the store writes it


OLD_ROWS = [
    old_params({}),
    old_params({"count": 2, "class": "gpu", "labels": {"model": "H100-PCIe-80GB"}, "template": "cuda12-h100"}),
    old_params({"contract": H100.to_json(), "memory_mib": 65536, "lifetime_s": 30.0, "tenant": "acme"}),
    old_params({"contract": H100.to_json(), "pin_memory": False, "vcpus": 8, "lifetime_s": 7}),
    {**old_params({"contract": TOOL.to_json()}), "network": {"mode": "allowlist", "egress": ["1.2.3.0/24:443/tcp"]}},
]


@pytest.mark.parametrize("row", OLD_ROWS, ids=range(len(OLD_ROWS)))
def test_a_row_the_dict_code_wrote_reads_back_and_writes_the_same_bytes(row: dict[str, Any]) -> None:
    text = stored(row)
    params = ReservationParams.from_json(json.loads(text))
    assert stored(params.to_json()) == text
    assert ("network" in params.to_json(), "tenant" in params.to_json()) == ("network" in row, "tenant" in row)


@settings(max_examples=60, deadline=None)
@given(
    count=st.integers(0, 64),
    accel_class=st.none() | st.sampled_from(["gpu", "accelerator"]),
    labels=st.dictionaries(st.text(min_size=1, max_size=8), st.text(max_size=8), max_size=3),
    memory=st.integers(64, 1 << 20),
    vcpus=st.integers(1, 256),
    pin=st.booleans(),
    lifetime=st.none() | st.floats(0.001, 31 * 86400) | st.integers(1, 86400),
    tenant=st.none() | st.text(min_size=1, max_size=12),
    contract=st.sampled_from([None, H100, TOOL]),
)
def test_any_params_the_dict_code_wrote_round_trip_byte_for_byte(
    count: int,
    accel_class: str | None,
    labels: dict[str, str],
    memory: int,
    vcpus: int,
    pin: bool,
    lifetime: float | None,
    tenant: str | None,
    contract: CompatibilityContract | None,
) -> None:
    req = {
        "count": count,
        "class": accel_class,
        "labels": labels,
        "memory_mib": memory,
        "vcpus": vcpus,
        "pin_memory": pin,
        "lifetime_s": lifetime,
        "tenant": tenant,
        "contract": None if contract is None else contract.to_json(),
    }
    text = stored(old_params(req))
    assert stored(ReservationParams.from_json(json.loads(text)).to_json()) == text


def test_the_journal_holds_what_the_dict_code_recorded_for_the_same_request(tmp_path: Path) -> None:
    node = Node.create(tmp_path, "h100x4")
    req = ReservationRequest(
        count=1, accel_class="gpu", labels=(("model", "H100-PCIe-80GB"),), template="cuda12-h100", contract=H100
    )
    node.cubelet.reserve("sb", ReservationRequest(**{**req.__dict__, "lifetime_s": 60.0, "tenant": "acme"}))
    with sqlite3.connect(node.cubelet.store.path) as c:
        (text,) = c.execute("SELECT params FROM reservations WHERE sandbox_id='sb'").fetchone()
    want = old_params(
        {
            "count": 1,
            "class": "gpu",
            "labels": {"model": "H100-PCIe-80GB"},
            "template": "cuda12-h100",
            "memory_mib": H100.memory_mib,  # the contract's memory and pinning win, as before
            "pin_memory": H100.pin_memory,
            "contract": H100.to_json(),
            "lifetime_s": 60.0,
            "tenant": "acme",
        }
    )
    assert text == stored(want)


def test_a_reservation_row_written_by_the_dict_code_is_served_and_released(tmp_path: Path) -> None:
    node = Node.create(tmp_path, "h100x2")
    res = node.cubelet.reserve("sb", ReservationRequest(count=1, contract=H100))
    row = old_params({"count": 1, "contract": H100.to_json(), "memory_mib": H100.memory_mib, "tenant": "t1"})
    with sqlite3.connect(node.cubelet.store.path) as c:
        c.execute("UPDATE reservations SET params=? WHERE sandbox_id='sb'", (stored(row),))
    got = node.cubelet.get_reservation("sb")
    assert got.params.tenant == "t1" and isinstance(got.params.contract, CarriedContract)
    assert got.params.contract.digest == H100.digest
    app = create_app(node.cubelet, local=True)
    served = TestClient(app).get("/v1/reservations/sb").json()["reservation"]["params"]
    assert json.dumps(served) == json.dumps(json.loads(stored(row)))  # the row as read back, key order too
    with pytest.raises(CubeError) as e:
        node.cubelet.reserve("sb", ReservationRequest(count=2, contract=H100))
    assert json.dumps(e.value.details["existing"]) == json.dumps(json.loads(stored(row)))
    node.cubelet.release("sb")
    assert node.cubelet.store.reservation("sb") is None and res.phase is ReservationPhase.RESERVED


def test_the_body_cubemaster_sends_is_the_json_it_sent_with_a_dict_contract() -> None:
    typed = ReservationBody.model_validate(
        {"sandbox_id": "sb-1", "class": "gpu", "template": "cuda12-h100", "contract": H100, "start": True}
    )
    old = {  # what `_sent` wrote when the field was a dict holding `contract.to_json()`
        "v": 1,
        "sandbox_id": "sb-1",
        "count": 1,
        "class": "gpu",
        "labels": {},
        "template": "cuda12-h100",
        "memory_mib": 512,
        "vcpus": 1,
        "pin_memory": True,
        "contract": H100.to_json(),
        "start": True,
    }
    assert json.dumps(_sent(typed)) == json.dumps(old)
    received = ReservationBody.model_validate(json.loads(json.dumps(old)))
    assert isinstance(received.contract, CarriedContract) and received.contract.digest == H100.digest
    assert json.dumps(_sent(received)) == json.dumps(old)  # passed on unchanged


def test_a_carried_contract_gives_back_the_json_it_came_as_not_a_rederivation() -> None:
    sent = H100.to_json()
    sent["guest_probes"]["modules"] = ["from-an-older-cubemaster"]  # derived, ignored on reading, passed on
    carried = parse_contract(sent)
    assert carried.to_json() == sent and carried == parse_contract(H100.to_json())
    carried.to_json()["document"]["spec"] = {}  # a caller's edit is its own
    assert carried.to_json() == sent


# ---- a malformed contract over HTTP keeps its code (the body is typed now; the Cubelet refused it before) ----


@pytest.fixture
def http(tmp_path: Path) -> tuple[Node, TestClient, Path]:
    node = Node.create(tmp_path, "h100x2")
    audit = tmp_path / "audit.jsonl"
    app = create_app(node.cubelet, local=True, audit=AuditLog(audit), peer_uids=frozenset({0}))
    return node, TestClient(app, raise_server_exceptions=False), audit


def _tampered() -> dict[str, Any]:
    c = H100.to_json()
    c["document"]["spec"]["memory"]["size_mib"] = 1024
    return c


@pytest.mark.parametrize(
    ("contract", "code", "layer"),
    [
        ({"document": {}}, "contract.invalid_json", "template"),
        ({**H100.to_json(), "contract_version": 2}, "contract.unsupported_version", "template"),
        (_tampered(), "contract.digest_mismatch", "template"),
        ({**H100.to_json(), "document": {**H100.to_json()["document"], "spec": "x"}}, None, "template"),
        ({"contract_version": 1, "template": {"digest": "d"}, "document": {"kind": 1}}, None, "template"),
        ([1, 2], "api.invalid_request", "api"),
        ("x", "api.invalid_request", "api"),
    ],
)
def test_a_malformed_contract_is_refused_with_its_code_and_no_reservation(
    http: tuple[Node, TestClient, Path], contract: object, code: str | None, layer: str
) -> None:
    node, client, audit = http
    r = client.post("/v1/reservations", json={"sandbox_id": "sb", "count": 1, "contract": contract, "tenant": "t"})
    err = r.json()["error"]
    assert r.status_code == 422 and err["layer"] == layer, r.text
    if code is not None:
        assert err["code"] == code
    else:  # whatever the template parser says, never a generic shape error
        assert err["code"] == "reserve.invalid_contract" or err["code"].startswith(("contract.", "template."))
    assert node.cubelet.store.reservation("sb") is None
    (row,) = [json.loads(x) for x in audit.read_text().splitlines()]
    assert row["reason"] == err["code"]
    if layer != "api":  # audited as the route refused it before: with whose sandbox it was
        assert (row["sandbox"], row["tenant"]) == ("sb", "t")


def test_a_malformed_contract_beside_another_bad_field_is_a_shape_error(http: tuple[Node, TestClient, Path]) -> None:
    _, client, _ = http
    r = client.post("/v1/reservations", json={"sandbox_id": "sb", "count": "1", "contract": {"document": {}}})
    assert r.status_code == 422 and r.json()["error"]["code"] == "api.invalid_request"


def test_an_inconsistent_contract_with_a_valid_digest_is_rechecked_by_the_cubelet(
    http: tuple[Node, TestClient, Path],
) -> None:
    from dataclasses import replace

    from cubeaccel.model.template_spec import KernelDriver

    _, client, _ = http
    old_driver = replace(H100.template, kernel_driver=KernelDriver("nvidia", "535.104.05"))  # too old for CUDA 12.4
    r = client.post("/v1/reservations", json={"sandbox_id": "sb", "contract": freeze(old_driver).to_json()})
    err = r.json()["error"]
    assert r.status_code == 422 and err["layer"] in ("cuda_runtime", "userspace_driver", "kernel_driver"), r.text
    assert err["message"].startswith("frozen contract is not consistent")


def test_a_warm_pool_with_a_malformed_contract_keeps_its_code(http: tuple[Node, TestClient, Path]) -> None:
    _, client, _ = http
    r = client.put("/v1/warm/pools", json={"size": 1, "contract": _tampered()})
    assert r.status_code == 422 and r.json()["error"]["code"] == "contract.digest_mismatch"
    r = client.put("/v1/warm/pools", json={"size": 1, "contract": {"document": {}}})
    assert r.status_code == 422 and r.json()["error"]["code"] == "contract.invalid_json"


# ---- the request's network narrowing: parsed at the edge, sent as given, refused with its own codes ----


@pytest.mark.parametrize(
    "network",
    [
        {"mode": "allowlist", "egress": ["10.1.0.0/16:443", "10.2.0.0/16:53/udp"]},  # not normalized: sent as given
        {"allow_out": ["10.1.2.3"], "deny_out": []},
        {"mode": "none"},
    ],
)
def test_the_body_carries_the_network_narrowing_as_sent(network: dict[str, Any]) -> None:
    typed = ReservationBody.model_validate({"sandbox_id": "sb-1", "contract": TOOL, "network": network})
    assert isinstance(typed.network, NetworkRequest)
    old = {"v": 1, "sandbox_id": "sb-1", "count": 1, "labels": {}, "memory_mib": 512, "vcpus": 1}
    old |= {"pin_memory": True, "contract": TOOL.to_json(), "start": False, "network": network}
    assert json.dumps(_sent(typed)) == json.dumps(old)


@pytest.mark.parametrize(
    ("network", "code"),
    [
        ({"mode": "open"}, "network.invalid_policy"),
        ({"mode": "allowlist", "egress": ["10.0.0.0/8"]}, "network.invalid_rule"),
        ({"allow_out": ["nowhere"]}, "network.invalid_rule"),
        ({"allow_out": [], "egress": []}, "network.invalid_policy"),
        ("allowlist", "api.invalid_request"),
    ],
)
def test_a_malformed_network_is_refused_with_its_code(
    http: tuple[Node, TestClient, Path], network: object, code: str
) -> None:
    node, client, audit = http
    body = {"sandbox_id": "sb", "contract": TOOL.to_json(), "network": network, "tenant": "t"}
    r = client.post("/v1/reservations", json=body)
    assert r.status_code == 422 and r.json()["error"]["code"] == code, r.text
    assert node.cubelet.store.reservation("sb") is None
    (row,) = [json.loads(x) for x in audit.read_text().splitlines()]
    if code != "api.invalid_request":
        assert (row["sandbox"], row["reason"]) == ("sb", code)


def test_a_network_narrowing_without_a_contract_is_still_refused_by_the_cubelet(
    http: tuple[Node, TestClient, Path],
) -> None:
    _, client, _ = http
    r = client.post("/v1/reservations", json={"sandbox_id": "sb", "network": {"mode": "none"}})
    assert r.status_code == 422 and r.json()["error"]["code"] == "network.policy_widened"


# ---- the params as the Cubelet serves them: typed, and the JSON the dict reply gave, byte for byte ----

NETWORKS = [
    None,
    {"mode": "none"},
    {"mode": "allowlist", "egress": ["1.2.3.0/24:443/tcp"]},
    {"mode": "allowlist", "egress": ["10.0.0.0/8:53/udp", "1.2.3.4/32:443/tcp"]},
]


def served(params: ReservationParams) -> str:
    """The params as a reply carries them (FastAPI dumps replies by alias)."""
    return json.dumps(W.ReservationParamsShown.of(params).model_dump(mode="json", by_alias=True))


@pytest.mark.parametrize("row", OLD_ROWS, ids=range(len(OLD_ROWS)))
def test_the_served_params_are_the_stored_row_byte_for_byte(row: dict[str, Any]) -> None:
    params = ReservationParams.from_json(json.loads(stored(row)))
    assert served(params) == json.dumps(params.as_stored()) == json.dumps(json.loads(stored(row)))


@settings(max_examples=80, deadline=None)
@given(
    count=st.integers(0, 64),
    accel_class=st.none() | st.sampled_from(["gpu", "accelerator"]),
    labels=st.dictionaries(st.text(min_size=1, max_size=8), st.text(max_size=8), max_size=3),
    memory=st.integers(64, 1 << 20),
    pin=st.booleans(),
    lifetime=st.none() | st.floats(0.001, 31 * 86400) | st.integers(1, 86400),
    tenant=st.none() | st.text(min_size=1, max_size=12),
    contract=st.sampled_from([None, H100, TOOL]),
    network=st.sampled_from(NETWORKS),
)
def test_any_params_are_served_as_the_dict_reply_served_them_and_read_back(
    count: int,
    accel_class: str | None,
    labels: dict[str, str],
    memory: int,
    pin: bool,
    lifetime: float | None,
    tenant: str | None,
    contract: CompatibilityContract | None,
    network: dict[str, Any] | None,
) -> None:
    req = {
        "count": count,
        "class": accel_class,
        "labels": labels,
        "memory_mib": memory,
        "pin_memory": pin,
        "lifetime_s": lifetime,
        "tenant": tenant,
        "network": network,
        "contract": None if contract is None else contract.to_json(),
    }
    params = ReservationParams.from_json(old_params(req))
    old = json.dumps(params.as_stored())  # what `Reservation.params` served as a dict
    assert served(params) == old
    shown = W.ReservationParamsShown.model_validate_json(old)  # what a client reads
    assert json.dumps(shown.model_dump(mode="json", by_alias=True)) == old
    assert (shown.count, shown.accel_class, shown.tenant, shown.lifetime_s) == (count, accel_class, tenant, lifetime)
    assert (shown.network is None) == (params.network is None)
    if shown.network is not None and params.network is not None:
        assert shown.network.model_dump(mode="json") == json.loads(json.dumps(params.network.to_json(), sort_keys=True))


def test_a_client_reads_the_params_by_attribute_and_refuses_a_malformed_one_by_name() -> None:
    params = ReservationParams.from_json(OLD_ROWS[4])
    shown = W.ReservationParamsShown.of(params)
    assert shown.network is not None and shown.network.mode == "allowlist"
    assert shown.network.egress == ["1.2.3.0/24:443/tcp"] and shown.contract == TOOL.to_json()
    bad = {**params.as_stored(), "count": "two"}
    with pytest.raises(ValidationError) as e:
        W.ReservationParamsShown.model_validate(bad)
    assert [err["loc"] for err in e.value.errors()] == [("count",)]


def test_an_older_cubelets_params_read_with_the_defaults_it_meant_and_serve_as_they_came() -> None:
    older = {"class": "gpu", "count": 2, "labels": {}, "memory_mib": 1024, "template": None}  # no vcpus, contract…
    shown = W.ReservationParamsShown.model_validate(older)
    assert (shown.vcpus, shown.pin_memory, shown.contract, shown.lifetime_s) == (1, True, None, None)
    assert json.dumps(shown.model_dump(mode="json", by_alias=True)) == json.dumps(older)
    assert "class" not in W.ReservationParamsShown.model_validate({"count": 1}).model_dump(by_alias=True)
