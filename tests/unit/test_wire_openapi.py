"""The served OpenAPI of both servers: typed replies, the real error body, no docs UI loading from a CDN.

Also the HTTP bodies' versions: a request of an unknown version is refused with `api.unsupported_version`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from cubeaccel.cubelet.server import create_app as cubelet_app
from cubeaccel.master.server import create_app as master_app
from cubeaccel.master.service import CubeMaster, MasterConfig
from cubeaccel.master.store import MasterStore
from cubeaccel.transport.api_edges import ErrorReply
from cubeaccel.wire import cubelet_api as CW
from cubeaccel.wire.base import Reply
from tests.support.cubelet_harness import Node
from tests.support.master_builders import Credentials

# Routes whose only reply is an error (the lifecycle verbs an accelerator sandbox refuses).
ALWAYS_REFUSED = {("post", "/v1/reservations/{sandbox_id}/{operation}")}


@pytest.fixture
def cubelet(node: Node) -> TestClient:
    return TestClient(cubelet_app(node.cubelet, local=True), raise_server_exceptions=False)


@pytest.fixture
def master(tmp_path: Path) -> Iterator[TestClient]:
    m = CubeMaster(MasterStore(str(tmp_path / "m.db")), MasterConfig(staleness_s=10.0))
    c = TestClient(master_app(m), raise_server_exceptions=False)
    c.auth = Credentials(m)
    yield c
    m.store.close()


@pytest.fixture(params=["cubelet", "master"])
def api(request: pytest.FixtureRequest) -> TestClient:
    client: TestClient = request.getfixturevalue(request.param)
    return client


def _operations(spec: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, item in spec["paths"].items():
        for method, op in item.items():
            yield method, path, op


def test_there_is_no_docs_ui_and_nothing_served_names_a_cdn(api: TestClient) -> None:
    for page in ("/docs", "/redoc", "/docs/oauth2-redirect"):
        r = api.get(page)
        assert r.status_code == 404 and r.json()["error"]["code"] == "api.not_found"
    text = api.get("/openapi.json").text
    assert "cdn." not in text and "<script" not in text


def test_every_route_documents_a_typed_reply(api: TestClient) -> None:
    spec = api.get("/openapi.json").json()
    untyped = []
    for method, path, op in _operations(spec):
        if (method, path) in ALWAYS_REFUSED:
            continue
        ok = [s for s in op["responses"] if s.startswith("2")]
        assert len(ok) == 1, (method, path)
        schema = op["responses"][ok[0]]["content"]["application/json"]["schema"]
        ref = schema.get("$ref", "")
        if not ref.startswith("#/components/schemas/"):
            untyped.append((method, path, schema))
            continue
        props = spec["components"]["schemas"][ref.rsplit("/", 1)[1]].get("properties", {})
        assert props, (method, path, ref)  # an object with named fields, not a bare dict
    assert untyped == []


def test_every_route_documents_the_error_body_our_replies_have(api: TestClient) -> None:
    spec = api.get("/openapi.json").json()
    for method, path, op in _operations(spec):
        for status in ("404", "422", "default"):
            schema = op["responses"][status]["content"]["application/json"]["schema"]
            assert schema == {"$ref": "#/components/schemas/ErrorReply"}, (method, path, status)
        assert "HTTPValidationError" not in str(op)  # FastAPI's own 422 shape is not what we send
    documented = spec["components"]["schemas"]["ErrorDetail"]["properties"].keys()
    real = api.get("/v1/no-such-route").json()
    ErrorReply.model_validate(real)  # the body really has that shape
    assert set(real["error"]) == set(documented) == {"code", "layer", "message", "details"}


def test_bodies_read_as_plain_dicts_are_still_documented(cubelet: TestClient, master: TestClient) -> None:
    def body_ref(client: TestClient, method: str, path: str) -> str:
        op = client.get("/openapi.json").json()["paths"][path][method]
        schema = op["requestBody"]["content"]["application/json"]["schema"]
        assert list(schema) == ["$ref"]
        ref: str = schema["$ref"]
        name = ref.rsplit("/", 1)[1]
        assert "properties" in client.get("/openapi.json").json()["components"]["schemas"][name]
        return name

    assert body_ref(cubelet, "post", "/v1/shim-reports") == "ShimReportBody"
    assert body_ref(master, "put", "/v1/nodes/{node}") == "Heartbeat"
    assert body_ref(master, "post", "/v1/templates") == "TemplateDocument"


def test_replies_carry_their_version(cubelet: TestClient, master: TestClient) -> None:
    assert cubelet.get("/v1/health").json()["v"] == 1
    assert cubelet.get("/v1/capacity").json()["v"] == 1
    assert master.get("/v1/capacity").json()["v"] == 1


@pytest.mark.parametrize(
    ("server", "method", "path", "body"),
    [
        ("cubelet", "POST", "/v1/reservations", {"sandbox_id": "sb-v", "count": 1}),
        ("cubelet", "POST", "/v1/devices/d/quarantine", {"who": "op", "reason": "r"}),
        ("master", "POST", "/v1/sandboxes", {"gpu": "H100:1"}),
        ("master", "PUT", "/v1/template-defaults/gpu", {"template": "t"}),
        ("master", "PUT", "/v1/nodes/n1/sandboxes/sb/status", {"phase": "running"}),
    ],
)
def test_a_request_of_an_unknown_version_is_refused_with_its_own_code(
    request: pytest.FixtureRequest, server: str, method: str, path: str, body: dict[str, Any]
) -> None:
    client: TestClient = request.getfixturevalue(server)
    r = client.request(method, path, json={**body, "v": 2})
    assert r.status_code == 422 and r.json()["error"]["code"] == "api.unsupported_version"
    assert "version 2" in r.json()["error"]["message"]
    r = client.request(method, path, json={**body, "an_unknown_field": 1})
    assert r.status_code == 422 and r.json()["error"]["code"] == "api.unknown_field"


def test_a_shim_report_of_an_unknown_version_is_refused(cubelet: TestClient) -> None:
    r = cubelet.post("/v1/shim-reports", json={"v": 2, "sandbox_id": "sb", "kind": "vm_started"})
    assert r.status_code == 422 and r.json()["error"]["code"] == "api.invalid_shim_report"
    assert "unsupported ShimReportBody version 2" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("route", "model"),
    [
        ("/v1/health", CW.Health),
        ("/v1/devices", CW.DeviceList),
        ("/v1/events", CW.EventPage),
        ("/v1/host", CW.HostReply),
        ("/v1/reservations", CW.ReservationList),
    ],
)
def test_cubelet_replies_round_trip_through_their_models(cubelet: TestClient, route: str, model: type[Reply]) -> None:
    body = cubelet.get(route).json()
    assert model.model_validate(body).model_dump(mode="json", by_alias=True) == body


def test_a_reservation_reply_round_trips_through_its_model(cubelet: TestClient) -> None:
    body = cubelet.post("/v1/reservations", json={"sandbox_id": "sb-rt", "count": 1}).json()
    assert body["devices"] and body["timeline"]
    assert CW.ReservationView.model_validate(body).model_dump(mode="json", by_alias=True) == body
    device = cubelet.get(f"/v1/devices/{body['devices'][0]['id']}").json()
    assert CW.DeviceReply.model_validate(device).model_dump(mode="json", by_alias=True) == device
    released = cubelet.delete("/v1/reservations/sb-rt").json()
    assert CW.Release.model_validate(released).model_dump(mode="json", by_alias=True) == released
