"""`Type=notify` readiness: each server sends READY=1 to $NOTIFY_SOCKET only once it answers requests.

The notify socket is a real unix datagram socket this test binds, as systemd's would be."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cubeaccel.host.service import sdnotify
from cubeaccel.transport.cubelet_client import CubeletClient
from cubeaccel.transport.master_client import MasterClient
from tests.support.cubelet_process import terminate
from tests.support.master_harness import free_port


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[socket.socket]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(tmp_path / "notify.sock"))
    s.settimeout(60)
    yield s
    s.close()


def _messages(s: socket.socket) -> dict[str, str]:
    data = s.recv(4096).decode()
    return dict(line.split("=", 1) for line in data.splitlines() if "=" in line)


def _start(args: list[str], notify: Path, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "NOTIFY_SOCKET": str(notify)}
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", "cubeaccel", *args], env=env, stdout=out, stderr=out)


def test_cubelet_is_ready_when_systemd_is_told_and_says_stopping_on_sigterm(
    tmp_path: Path, notify_socket: socket.socket
) -> None:
    state = tmp_path / "cubelet"
    proc = _start(
        ["cubelet", "serve", "--backend", "simulated", "--state-dir", str(state)],
        tmp_path / "notify.sock",
        tmp_path / "log",
    )
    try:
        msg = _messages(notify_socket)
        assert msg["READY"] == "1" and msg["MAINPID"] == str(proc.pid)
        c = CubeletClient(socket=state / "cubelet.sock")
        assert c.health().status == "ok"  # at READY the socket already serves: no retry needed
        c.close()
        proc.send_signal(signal.SIGTERM)
        assert _messages(notify_socket) == {"STOPPING": "1"}
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it caught
    finally:
        terminate(proc)


def test_cubemaster_is_ready_when_systemd_is_told(tmp_path: Path, notify_socket: socket.socket) -> None:
    port = free_port()
    proc = _start(
        ["master", "serve", "--state-dir", str(tmp_path / "m"), "--listen", f"127.0.0.1:{port}"],
        tmp_path / "notify.sock",
        tmp_path / "log",
    )
    try:
        msg = _messages(notify_socket)
        assert msg["READY"] == "1" and f"127.0.0.1:{port}" in msg["STATUS"]
        c = MasterClient(f"http://127.0.0.1:{port}")
        assert c.health().status == "ok"
        c.close()
    finally:
        terminate(proc)


def test_notify_reaches_an_abstract_socket_and_is_a_no_op_outside_systemd(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"cubeaccel-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind("\0" + name)
        s.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert sdnotify.ready("x")
        assert _messages(s)["READY"] == "1"
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert sdnotify.ready("x") is False


def test_a_server_without_a_started_flag_is_ready_once_it_accepts(
    notify_socket: socket.socket, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`when_listening`, for the front door (Hypercorn): READY only after the port accepts a connection."""
    import asyncio

    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify.sock"))
    port = free_port()

    async def scenario() -> bool:
        waiter = asyncio.create_task(sdnotify.when_listening("127.0.0.1", port, "api"))
        await asyncio.sleep(0.3)
        assert not waiter.done()  # nothing listens yet: no READY
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", port)
        try:
            return await asyncio.wait_for(waiter, 10)
        finally:
            server.close()

    assert asyncio.run(scenario())
    assert _messages(notify_socket)["READY"] == "1"
