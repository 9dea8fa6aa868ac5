"""Values inside an E2B request that the front door parses itself: the `cubeaccel.accelerators` metadata value and
a list's `nextToken`. A hostile one (nested deep enough to exhaust Python's recursion limit) is a 400 in E2B's JSON
error format naming the code, never a 500 `text/plain`; and whatever still escapes a route is answered in E2B's
format too."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from cubeaccel.frontdoor import mapping as M
from cubeaccel.frontdoor.app import FrontDoorConfig, create_app
from cubeaccel.frontdoor.master import FrontDoorMaster
from cubeaccel.wire.e2b_api import NewSandbox

DEEP = "[" * 1000 + "]" * 1000  # 2,000 characters: fits a metadata value (2,048)


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    async def id_prefix(self: FrontDoorMaster, key: str) -> str:
        return "sb-"  # CubeMaster's whoami, not reached: the request is refused before any create

    monkeypatch.setattr(FrontDoorMaster, "id_prefix", id_prefix)
    cfg = FrontDoorConfig(master_url="http://127.0.0.1:9", admin_key="admin", secret=b"s" * 32)
    with TestClient(create_app(cfg), raise_server_exceptions=False) as client:
        yield client


def test_a_1000_deep_accelerators_value_is_a_json_400_naming_the_code(api: TestClient) -> None:
    r = api.post(
        "/sandboxes",
        json={"templateID": "base", "metadata": {M.ACCELERATORS_KEY: DEEP}},
        headers={"X-API-Key": "e2b_" + "0" * 72},
    )
    assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
    assert "api.too_deep" in r.json()["message"] and M.ACCELERATORS_KEY in r.json()["message"]


def test_create_body_refuses_a_deep_accelerators_value_by_code() -> None:
    req = NewSandbox.model_validate({"templateID": "x", "metadata": {M.ACCELERATORS_KEY: DEEP}})
    with pytest.raises(M.Refusal) as e:
        M.create_body(req, "sb-1", "t" * 43)
    assert e.value.status == 400 and "api.too_deep" in e.value.message


def test_a_deep_next_token_is_an_invalid_token() -> None:
    token = base64.urlsafe_b64encode(DEEP.encode() * 4).decode().rstrip("=")
    with pytest.raises(M.Refusal) as e:
        M.page([], 10, token)
    assert (e.value.status, e.value.message) == (400, "cubeaccel (api): invalid nextToken")


def test_an_unexpected_error_in_a_route_is_a_500_in_e2bs_format(
    api: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object) -> object:
        raise RuntimeError("a bug")

    monkeypatch.setattr(M, "create_body", broken)
    r = api.post("/sandboxes", json={"templateID": "base"}, headers={"X-API-Key": "e2b_" + "0" * 72})
    assert r.status_code == 500 and r.headers["content-type"] == "application/json", r.text
    assert r.json()["code"] == 500 and "a bug" not in r.text
