"""The Cubelet API over its unix socket, against a real `cubeaccel cubelet serve` process."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from cubeaccel.protocol.errors import CubeError
from cubeaccel.transport.cubelet_client import CubeletClient
from tests.support.cubelet_process import CubeletProcess


def _raw(p: CubeletProcess) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(p.state_dir / "cubelet.sock")), base_url="http://cubelet")


def _snapshot(p: CubeletProcess) -> Any:
    return p.client.devices(), p.client.events().next


def test_stable_shapes_and_full_cycle(cubelet: CubeletProcess) -> None:
    c = cubelet.client
    devs = c.devices()
    assert len(devs) == 8
    assert {"id", "address", "state", "sandbox_id", "reason", "labels"} <= set(
        c.request("GET", "/v1/devices")["devices"][0]
    )
    body = c.reserve("sb-1", 2, start=True)
    assert [d.state for d in body.devices] == ["attached", "attached"]
    out = c.release("sb-1")
    assert out.released is True
    assert all(d.state == "allocatable" for d in c.devices())
    cap = c.capacity()
    assert cap.allocatable == 8 and cap.groups[0].labels["model"] == "H100-PCIe-80GB"
    kinds = [e.kind for e in c.events().events]
    assert "reservation_created" in kinds and "reservation_closed" in kinds and "reconcile_repair" not in kinds


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"{not json", "api.malformed_json"),
        (b'{"sandbox_id": "a", "count": 1, "gpus": 2}', "api.unknown_field"),
        (b'{"sandbox_id": "a", "count": -1}', "reserve.invalid_count"),
        (b'{"sandbox_id": "a", "count": 0}', "reserve.invalid_count"),
        (b'{"sandbox_id": "a", "count": 100000000000000000000}', "reserve.invalid_count"),
        (b'{"sandbox_id": "a", "count": "2"}', "api.invalid_request"),
        (b'{"sandbox_id": "../etc/passwd", "count": 1}', "reserve.invalid_sandbox_id"),
        (b'{"sandbox_id": "a\\nb", "count": 1}', "reserve.invalid_sandbox_id"),
        (b'{"count": 1}', "api.invalid_request"),
        (b"[]", "api.invalid_request"),
    ],
)
def test_bad_reservation_input_is_4xx_with_a_stable_code_and_changes_nothing(
    cubelet: CubeletProcess, body: bytes, code: str
) -> None:
    before = _snapshot(cubelet)
    with _raw(cubelet) as h:
        r = h.post("/v1/reservations", content=body, headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500
    assert r.json()["error"]["code"] == code
    assert set(r.json()["error"]) == {"code", "layer", "message", "details"}
    assert _snapshot(cubelet) == before


def test_unknown_ids_and_verbs_and_path_tricks(cubelet: CubeletProcess) -> None:
    with _raw(cubelet) as h:
        assert h.get("/v1/devices/nope").json()["error"]["code"] == "device.not_found"
        r = h.post("/v1/devices/vfio-0000:10:00.0/explode", json={"who": "a", "reason": "b"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "api.unknown_verb"
        r = h.post("/v1/devices/vfio-0000:10:00.0/quarantine", json={"who": "", "reason": "b"})
        assert r.status_code == 422
        r = h.delete("/v1/reservations/ghost")
        assert r.status_code == 404 and r.json()["error"]["code"] == "reservation.not_found"
        r = h.get("/v1/events", params={"since": -1})
        assert r.json()["error"]["code"] == "api.invalid_cursor"
        r = h.get("/v1/events", params={"sandbox_id": "../etc"})
        assert r.status_code == 422 and r.json()["error"]["code"] == "reserve.invalid_sandbox_id"
        r = h.post("/v1/shim-reports", json={"sandbox_id": "x", "kind": "nonsense"})
        assert r.json()["error"]["code"] == "api.invalid_shim_report"


def test_same_sandbox_different_parameters_is_a_conflict(cubelet: CubeletProcess) -> None:
    c = cubelet.client
    c.reserve("sb", 1)
    again = c.reserve("sb", 1).reservation  # idempotent
    assert again is not None and again.device_ids
    before = _snapshot(cubelet)
    with pytest.raises(CubeError) as err:
        c.reserve("sb", 2)
    assert err.value.code == "reserve.sandbox_conflict" and err.value.status == 409
    assert _snapshot(cubelet) == before


def test_operator_verbs_over_http_are_audited(cubelet: CubeletProcess) -> None:
    c = cubelet.client
    dev = c.devices()[0].id
    since = c.events().next  # the module's Cubelet: earlier tests' events are not this test's
    assert c.verb(dev, "quarantine", "alice", "ECC").state == "quarantined"
    assert c.verb(dev, "recover", "bob", "clean").state == "allocatable"
    ops = [e for e in c.events(since).events if e.actor == "operator"]
    assert [(e.event, e.details["who"]) for e in ops] == [("quarantine", "alice"), ("recover", "bob")]


def test_64_concurrent_reservations_against_8_devices_exactly_8_succeed(cubelet: CubeletProcess) -> None:
    sock = cubelet.state_dir / "cubelet.sock"

    def attempt(i: int) -> str:
        client = CubeletClient(socket=sock)
        try:
            client.reserve(f"sb-{i}", 1)
            return "ok"
        except CubeError as e:
            return e.code
        finally:
            client.close()

    with ThreadPoolExecutor(max_workers=64) as pool:
        results = list(pool.map(attempt, range(64)))
    assert results.count("ok") == 8
    assert set(results) == {"ok", "reserve.insufficient_devices"}
    with pytest.raises(CubeError) as err:
        cubelet.client.reserve("one-more", 1)
    assert err.value.details == {"requested": 1, "devices_by_state": {"reserved": 8}}
    devs = cubelet.client.devices()
    owners = [d.sandbox_id for d in devs]
    assert len(set(owners)) == 8 and all(d.state == "reserved" for d in devs)


@pytest.mark.parametrize("op", ["snapshot", "clone", "rollback", "pause", "resume", "live_migration"])
def test_lifecycle_operations_a_device_cannot_survive_are_refused(cubelet: CubeletProcess, op: str) -> None:
    cubelet.client.reserve("sb", 1, start=True)
    with pytest.raises(CubeError) as err:
        cubelet.client.request("POST", f"/v1/reservations/sb/{op}")
    assert (err.value.status, err.value.code) == (409, "lifecycle.unsupported_for_accelerator")
    assert err.value.details["operation"] == op
    assert {d.state for d in cubelet.client.devices() if d.sandbox_id == "sb"} == {"attached"}


def test_unknown_lifecycle_operation_and_unknown_sandbox(cubelet: CubeletProcess) -> None:
    cubelet.client.reserve("sb", 1)
    with pytest.raises(CubeError) as err:
        cubelet.client.request("POST", "/v1/reservations/sb/teleport")
    assert err.value.code == "lifecycle.unknown_operation"
    with pytest.raises(CubeError) as err:
        cubelet.client.request("POST", "/v1/reservations/ghost/snapshot")
    assert err.value.code == "reservation.not_found"
