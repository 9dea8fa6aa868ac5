"""The fleet simulator's parts without CubeMaster: addresses, the in-memory journal, the node API's rules."""

from __future__ import annotations

import asyncio
import json

from hypothesis import given
from hypothesis import strategies as st

from cubeaccel.fleet.api import Faults, FleetApi
from cubeaccel.fleet.http import NodeRequest, node_address, node_index
from cubeaccel.fleet.journal import FleetLedger, NodeJournal
from cubeaccel.protocol.errors import CubeError
from cubeaccel.transport import node_sig
from cubeaccel.wire.cubelet_api import Release, ReservationView


@given(st.integers(0, 2_000_000))
def test_each_node_has_its_own_loopback_address_and_is_found_from_it(i: int) -> None:
    addr = node_address(i)
    assert addr.startswith("127.") and not addr.startswith("127.0.")
    assert node_index(addr) == i


@given(st.sampled_from(["127.0.0.1", "10.0.0.1", "127.1.0.0", "127.1.250.1", "127.1.1.251", "x"]))
def test_an_address_no_node_has_names_none(addr: str) -> None:
    assert node_index(addr) is None


ops = st.lists(st.tuples(st.sampled_from(["reserve", "release"]), st.integers(0, 9), st.integers(1, 8)), max_size=60)


@given(ops)
def test_a_journal_never_hands_a_device_to_two_sandboxes(steps: list[tuple[str, int, int]]) -> None:
    ledger = FleetLedger()
    j = NodeJournal("n", 8, ledger)
    for op, k, count in steps:
        sid = f"sb-{k}"
        try:
            if op == "reserve":
                before = j.reservations.get(sid)
                res = j.reserve(sid, count, {"count": count}, None)
                assert before is None or res is before
            else:
                j.release(sid)
        except CubeError as e:
            assert e.code in ("reserve.insufficient_devices", "reserve.sandbox_conflict", "reservation.not_found")
        held = [d for r in j.reservations.values() for d in r.device_ids]
        assert len(held) == len(set(held)) == 8 - j.free
        assert j.holder == {d: r.sandbox_id for r in j.reservations.values() for d in r.device_ids}
    assert ledger.double_placements == 0
    assert ledger.held() == 8 - j.free


def _api() -> tuple[FleetApi, str]:
    token = "cbn:n0:1:" + "ab" * 32
    return FleetApi([NodeJournal("n0", 8, FleetLedger())], [token], Faults()), token


def _request(method: str, path: str, body: bytes, token: str | None) -> NodeRequest:
    headers = {} if token is None else {k.lower(): v for k, v in node_sig.sign(token, method, path, body).items()}
    return NodeRequest(0, method, path, "", headers, body)


def test_a_simulated_node_refuses_an_unsigned_call_and_answers_a_signed_one_with_the_cubelets_models() -> None:
    api, token = _api()
    body = json.dumps({"sandbox_id": "sb-1", "count": 2, "class": "gpu", "start": True}).encode()
    refused = asyncio.run(api(_request("POST", "/v1/reservations", body, None)))
    assert refused is not None and refused[0] == 401 and refused[1]["error"]["code"] == "auth.invalid_credential"
    assert api.journals[0].free == 8

    reply = asyncio.run(api(_request("POST", "/v1/reservations", body, token)))
    assert reply is not None and reply[0] == 201
    view = ReservationView.model_validate(reply[1])
    assert view.reservation is not None and len(view.reservation.device_ids) == 2 and view.access_token
    released = asyncio.run(api(_request("DELETE", "/v1/reservations/sb-1", b"", token)))
    assert released is not None and Release.model_validate(released[1]).released
    assert api.journals[0].free == 8


def test_a_dead_node_answers_nothing_and_keeps_what_it_holds() -> None:
    api, token = _api()
    body = json.dumps({"sandbox_id": "sb-1", "count": 1}).encode()
    assert asyncio.run(api(_request("POST", "/v1/reservations", body, token))) is not None
    api.faults.dead.add(0)
    assert asyncio.run(api(_request("GET", "/v1/reservations/sb-1", b"", token))) is None
    assert api.counters.dropped == 1 and api.journals[0].free == 7


def test_fleet_simulate_refuses_an_unknown_profile_before_touching_cubemaster() -> None:
    from typer.testing import CliRunner

    from cubeaccel.cli.root import app

    r = CliRunner().invoke(app, ["fleet", "simulate", "--master", "http://127.0.0.1:1", "--profile", "calm"])
    assert r.exit_code == 2 and "unknown profile 'calm'" in r.output
