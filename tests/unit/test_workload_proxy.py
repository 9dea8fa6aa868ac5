"""Cubelet's workload proxy with a real Cubelet (simulated host), the shim's real bridge and the real guest
service behind it (no VM): connection reuse and a clear error when the guest's side breaks mid-stream."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import strategies as st

from cubeaccel.cubelet.api.workload import _EnvelopeTracker
from cubeaccel.cubelet.lifecycle import ReservationRequest
from cubeaccel.cubelet.server import create_app
from cubeaccel.protocol.mux import data_frame
from cubeaccel.shim.workload_bridge import WorkloadBridge
from cubeaccel.workload.connect import encode_envelope
from tests.support.cubelet_harness import Node
from tests.unit.test_workload_bridge import FakePort
from tests.unit.test_workload_bridge_recovery import ScriptedGuest, echo
from tests.workload_client import WorkloadClient


def _running(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sock: Path) -> tuple[Node, str]:
    (tmp_path / "node").mkdir()
    node = Node.create(tmp_path / "node")
    node.cubelet.reserve("sb", ReservationRequest(count=1))
    node.cubelet.start("sb")
    token = node.cubelet.take_token("sb")
    assert token is not None
    monkeypatch.setattr(node.shim, "workload_socket", lambda sandbox_id: sock, raising=False)
    return node, token


@pytest.fixture
def proxied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[WorkloadBridge, WorkloadClient]]:
    node, token = _running(tmp_path, monkeypatch, tmp_path / "workload.sock")
    port = FakePort(tmp_path / "vmm.sock")
    bridge = WorkloadBridge(tmp_path / "vmm.sock", tmp_path / "workload.sock", token)
    bridge.start(10)
    bridge.wait_healthy(30)
    try:
        with TestClient(create_app(node.cubelet), base_url="http://cubelet/v1/sandboxes/sb/workload") as tc:
            yield bridge, WorkloadClient(tc, token)
    finally:
        bridge.close()
        port.stop()
        node.cubelet.store.close()


def test_the_proxy_reuses_its_connection_to_the_shim(proxied: tuple[WorkloadBridge, WorkloadClient]) -> None:
    bridge, wl = proxied
    before = bridge.connections
    for i in range(10):
        assert echo(wl, f"{i}") == f"{i}\n".encode()
        assert wl.http.get("/files", params={"path": "/etc/hostname"}, headers=wl.headers()).status_code in (
            200,
            404,
        )
    assert bridge.connections - before == 1  # 20 calls, one upstream connection (one mux stream) kept alive


def test_a_guest_that_breaks_mid_stream_ends_the_stream_with_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = encode_envelope({"event": {"start": {"pid": 7}}})

    def script(conn: socket.socket) -> None:
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/connect+json\r\nTransfer-Encoding: chunked\r\n\r\n"
        conn.sendall(data_frame(1, head + f"{len(first):x}\r\n".encode() + first + b"\r\n").encode())
        conn.close()  # the guest's side of the channel goes away mid-stream

    node, token = _running(tmp_path, monkeypatch, tmp_path / "workload.sock")
    guest = ScriptedGuest(tmp_path / "vmm.sock", script)
    bridge = WorkloadBridge(tmp_path / "vmm.sock", tmp_path / "workload.sock", token)
    bridge.start(5)
    try:
        with TestClient(create_app(node.cubelet), base_url="http://cubelet/v1/sandboxes/sb/workload") as tc:
            s = WorkloadClient(tc, token).collect("process.Process/Start", {"process": {"cmd": "/bin/true"}})
        assert s.events == [{"event": {"start": {"pid": 7}}}]
        assert s.error is not None and s.error["code"] == "unavailable"
        assert "workload.channel_closed" in s.error["message"]
    finally:
        bridge.close()
        guest.stop()
        node.cubelet.store.close()


def test_a_sandbox_torn_down_mid_stream_has_its_stream_cut_as_e2b_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SDK (2.45 on) tells "killed" from a cut connection plus a health probe that says gone; an end-of-stream
    error envelope would read as a mere timeout, so a sandbox that is no longer running gets no envelope."""
    first = encode_envelope({"event": {"start": {"pid": 7}}})
    node, token = _running(tmp_path, monkeypatch, tmp_path / "workload.sock")

    def script(conn: socket.socket) -> None:
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/connect+json\r\nTransfer-Encoding: chunked\r\n\r\n"
        conn.sendall(data_frame(1, head + f"{len(first):x}\r\n".encode() + first + b"\r\n").encode())
        node.cubelet.release("sb")  # the sandbox is killed: teardown begins, then its guest goes away
        conn.close()

    guest = ScriptedGuest(tmp_path / "vmm.sock", script)
    bridge = WorkloadBridge(tmp_path / "vmm.sock", tmp_path / "workload.sock", token)
    bridge.start(5)
    try:
        with TestClient(create_app(node.cubelet), base_url="http://cubelet/v1/sandboxes/sb/workload") as tc:
            seen: list[dict[str, Any]] = []
            wl = WorkloadClient(tc, token)
            with (
                pytest.raises(httpx.HTTPError),
                wl.stream("process.Process/Start", {"process": {"cmd": "/bin/true"}}) as m,
            ):
                seen.extend(m)
        assert seen == [{"event": {"start": {"pid": 7}}}]  # and no end-of-stream envelope after it
    finally:
        bridge.close()
        guest.stop()
        node.cubelet.store.close()


@given(
    st.lists(st.dictionaries(st.text(max_size=5), st.text(max_size=40), max_size=3), min_size=1, max_size=6),
    st.lists(st.integers(1, 70), min_size=1, max_size=30),
)
def test_the_envelope_tracker_knows_the_boundaries_however_bytes_are_cut(msgs: list[Any], cuts: list[int]) -> None:
    envelopes = [encode_envelope(m) for m in msgs]
    wire = b"".join(envelopes)
    boundaries, at = {0}, 0
    for e in envelopes:
        at += len(e)
        boundaries.add(at)
    tracker, pos, i = _EnvelopeTracker(), 0, 0
    while pos < len(wire):
        step = cuts[i % len(cuts)]
        tracker.feed(wire[pos : pos + step])
        pos = min(len(wire), pos + step)
        i += 1
        assert tracker.at_boundary == (pos in boundaries), (pos, sorted(boundaries))
    ended = _EnvelopeTracker()
    ended.feed(wire + bytes([0x02, 0, 0, 0, 2]) + b"{}")
    assert ended.ended and not ended.at_boundary  # after the end-of-stream envelope nothing may be appended
