"""The shim's agent client against a hostile guest: every bad reply is a CubeError, bounded in time and memory."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from cubeaccel.protocol.errors import CubeError
from cubeaccel.shim.agent_client import MAX_REPLY, AgentClient


def _guest(path: Path, reply: bytes) -> threading.Thread:
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(1)

    def serve() -> None:
        conn, _ = srv.accept()
        conn.recv(65536)  # the request
        with contextlib.suppress(OSError):  # the client hangs up on a flood: as intended
            conn.sendall(reply)
        conn.close()
        srv.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return t


@pytest.fixture
def sock(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "agent.sock"


@pytest.mark.parametrize(
    ("reply", "code"),
    [
        (b'{"v":1,"id":1,"ok":false,"error":"x"}\n', "agent.bad_reply"),
        (b'{"v":1,"id":1,"ok":false,"error":[1,2]}\n', "agent.bad_reply"),
        (b"[" * 200_000 + b"\n", "agent.disconnected"),  # unparsable (too deep): ignored, then the guest hangs up
        (b"x" * (MAX_REPLY + 70_000), "agent.reply_too_large"),  # no newline: the buffer is capped
        (b'{"v":1,"id":1,"ok":"yes","result":{}}\n', "agent.bad_reply"),  # "ok" must be true, not truthy
    ],
)
def test_bad_replies_become_coded_errors(sock: Path, reply: bytes, code: str) -> None:
    t = _guest(sock, reply)
    client = AgentClient(sock)
    client.connect(5)
    with pytest.raises(CubeError) as err:
        client.call("hello", timeout_s=5)
    assert err.value.code == code
    client.close()
    t.join(5)


def test_a_silent_guest_times_out(sock: Path) -> None:
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(sock))
    srv.listen(1)
    client = AgentClient(sock)
    client.connect(5)
    with pytest.raises(CubeError) as err:
        client.call("hello", timeout_s=0.3)
    assert err.value.code == "agent.timeout"
    client.close()
    srv.close()


@pytest.mark.parametrize("said", ["shim.stop_requested", "agent.cancelled", "agent.timeout", "cubelet.x", ""])
def test_a_guest_cannot_reply_with_a_host_code(sock: Path, said: str) -> None:
    """Issue 19 #5: the shim ends as a requested stop on shim.stop_requested / agent.cancelled; a guest saying
    so is an agent error, with its words kept as details."""
    reply = b'{"v":1,"id":1,"ok":false,"error":{"code":"%s","layer":"cubelet","message":"stop"}}\n' % said.encode()
    t = _guest(sock, reply)
    client = AgentClient(sock)
    client.connect(5)
    with pytest.raises(CubeError) as err:
        client.call("probe", timeout_s=5)
    assert err.value.code == "agent.error" and err.value.layer == "agent"
    assert err.value.details["guest_code"] == said
    client.close()
    t.join(5)


def test_a_known_guest_code_is_kept(sock: Path) -> None:
    t = _guest(sock, b'{"v":1,"id":1,"ok":false,"error":{"code":"agent.unknown_method","message":"no"}}\n')
    client = AgentClient(sock)
    client.connect(5)
    with pytest.raises(CubeError) as err:
        client.call("nope", timeout_s=5)
    assert err.value.code == "agent.unknown_method" and "guest_code" not in err.value.details
    client.close()
    t.join(5)


def test_every_guest_side_code_in_the_catalog_is_one_the_client_keeps() -> None:
    from cubeaccel.protocol.agent_protocol import GUEST_ERROR_CODES
    from cubeaccel.protocol.error_catalog import CODES

    assert {c.code for c in CODES if c.meaning.startswith("guest:")} == GUEST_ERROR_CODES


def test_a_guest_that_stops_reading_cannot_stretch_the_calls_bound(sock: Path) -> None:
    """The send had a fixed 10 s whatever the call's bound: a 1 s call overran by 9 s."""
    import time

    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(sock))
    srv.listen(1)
    client = AgentClient(sock)
    client.connect(5)
    conn, _ = srv.accept()  # and never reads
    t0 = time.monotonic()
    with pytest.raises(CubeError) as err:
        client.call("probe", {"pad": "x" * (16 << 20)}, timeout_s=1.0)
    assert err.value.code == "agent.timeout"
    assert time.monotonic() - t0 < 2.5
    client.close()
    conn.close()
    srv.close()


def test_a_reply_with_non_finite_numbers_is_unreadable_not_passed_on(sock: Path) -> None:
    t = _guest(sock, b'{"v":1,"id":1,"ok":true,"result":{"report":{"agent_version":Infinity}}}\n')
    client = AgentClient(sock)
    client.connect(5)
    with pytest.raises(CubeError) as err:  # the line is skipped; the guest then hangs up
        client.call("probe", timeout_s=5)
    assert err.value.code == "agent.disconnected"
    client.close()
    t.join(5)
