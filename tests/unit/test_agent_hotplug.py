"""`wait_pci` (issue 18, deliverable 6): the guest answers once a hot-plugged function appears, so the shim sends
one request instead of a probe before `device_add` and one every 20 ms after it."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from cubeaccel.agent.hotplug import find_new, wait_pci
from cubeaccel.agent.probes import ProbeContext
from cubeaccel.agent.protocol import Agent
from cubeaccel.protocol.agent_messages import METHODS
from tests.unit.test_agent_fakes import FakeGuest

BOOT = ("0000:00:00.0", "0000:00:01.0")


def guest(tmp_path: Path) -> FakeGuest:
    g = FakeGuest(tmp_path)
    g.pci(BOOT[0], "8086", "29c0").pci(BOOT[1], "1234", "11e8")  # an edu already there before the hot-plug
    return g


def test_a_function_already_known_is_never_the_new_one(tmp_path: Path) -> None:
    ctx = ProbeContext(root=guest(tmp_path).root)
    assert find_new(ctx, "1234", "11e8", frozenset(BOOT)) is None
    reply = wait_pci(ctx, "1234", "11e8", frozenset(BOOT), timeout_s=0.2)
    assert reply.device is None and (reply.waited_ms or 0) >= 200 and reply.uevents is False


def test_a_function_that_appears_while_waiting_is_answered_with_its_address(tmp_path: Path) -> None:
    g = guest(tmp_path)
    ctx = ProbeContext(root=g.root)
    plug = threading.Timer(0.15, lambda: g.pci("0000:01:00.0", "1234", "11e8"))
    plug.start()
    try:
        reply = wait_pci(ctx, "1234", "11e8", frozenset(BOOT), timeout_s=10)
    finally:
        plug.join()
    assert reply.to_json()["device"] == {
        "address": "0000:01:00.0",
        "vendor_id": "1234",
        "device_id": "11e8",
        "class": "00ff00",
    }
    assert 100 <= (reply.waited_ms or 0) < 10_000


def test_another_vendor_device_appearing_does_not_end_the_wait(tmp_path: Path) -> None:
    g = guest(tmp_path).pci("0000:02:00.0", "10de", "2330")
    reply = wait_pci(ProbeContext(root=g.root), "1234", "11e8", frozenset(BOOT), timeout_s=0.1).to_json()
    assert reply["device"] is None


def test_hello_names_the_functions_present_and_offers_wait_pci(tmp_path: Path) -> None:
    hello = Agent(ctx=ProbeContext(root=guest(tmp_path).root)).hello()
    assert (
        hello.to_json()["pci_addresses"] == list(BOOT) and "wait_pci" in (hello.methods or ()) and "wait_pci" in METHODS
    )


@pytest.mark.parametrize(
    "params",
    [
        {"vendor_id": "12345", "device_id": "11e8"},
        {"vendor_id": "1234", "device_id": "11E8"},
        {"vendor_id": "1234", "device_id": "11e8", "known": "0000:00:00.0"},
        {"vendor_id": "1234", "device_id": "11e8", "known": ["../../etc"]},
        {"vendor_id": "1234", "device_id": "11e8", "known": ["0000:00:00.0"] * 1025},
        {"vendor_id": "1234", "device_id": "11e8", "timeout_s": 0},
        {"vendor_id": "1234", "device_id": "11e8", "timeout_s": 31},
        {"vendor_id": "1234", "device_id": "11e8", "timeout_s": True},
    ],
)
def test_bad_wait_pci_params_are_refused_without_waiting(tmp_path: Path, params: dict[str, object]) -> None:
    line = json.dumps({"v": 1, "id": 1, "method": "wait_pci", "params": params}).encode()
    reply = Agent(ctx=ProbeContext(root=guest(tmp_path).root)).handle_line(line)
    assert reply is not None and reply["ok"] is False and reply["error"]["code"] == "agent.invalid_params"


def test_wait_pci_over_the_protocol_returns_the_new_function(tmp_path: Path) -> None:
    g = guest(tmp_path).pci("0000:01:00.0", "1234", "11e8")
    line = json.dumps(
        {
            "v": 1,
            "id": 7,
            "method": "wait_pci",
            "params": {"vendor_id": "1234", "device_id": "11e8", "known": list(BOOT)},
        }
    ).encode()
    reply = Agent(ctx=ProbeContext(root=g.root)).handle_line(line)
    assert reply is not None and reply["ok"] is True and reply["result"]["device"]["address"] == "0000:01:00.0"
