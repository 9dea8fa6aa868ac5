"""The shim's agent client against a hostile guest: every bad reply is a CubeError, bounded in time and memory."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from cubeaccel.model.errors import CubeError
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
