"""The shim's workload bridge against the real guest service, without a VM: a unix socket stands in for the VMM's
virtserialport chardev; the service reads the token preamble from it (`--token-from-channel`), as in a guest."""

from __future__ import annotations

import os
import secrets
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cubeaccel.protocol.errors import CubeError
from cubeaccel.protocol.mux import parse_preamble, token_preamble
from cubeaccel.shim.workload_bridge import WorkloadBridge
from tests.workload_client import ROOT, WorkloadClient

MiB = 1024 * 1024


class FakePort:
    """Listens where the VMM would; the first connection's socket is handed to the service as its channel fd."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(1)
        self.proc: subprocess.Popen[bytes] | None = None
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        conn, _ = self.sock.accept()
        fd = conn.detach()
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        cmd = [sys.executable, "-m", "cubeaccel.workload", "serve", "--mux-fd", str(fd), "--token-from-channel"]
        self.proc = subprocess.Popen(cmd, pass_fds=(fd,), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        os.close(fd)

    def stop(self) -> None:
        self.sock.close()
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)


@pytest.fixture
def bridged(tmp_path: Path) -> Iterator[tuple[WorkloadBridge, WorkloadClient]]:
    port = FakePort(tmp_path / "workload-vmm.sock")
    token = secrets.token_urlsafe(24)
    bridge = WorkloadBridge(tmp_path / "workload-vmm.sock", tmp_path / "workload.sock", token)
    bridge.start(10)
    bridge.wait_healthy(30)
    http = httpx.Client(transport=httpx.HTTPTransport(uds=str(tmp_path / "workload.sock")), base_url="http://w")
    try:
        yield bridge, WorkloadClient(http, token)
    finally:
        http.close()
        bridge.close()
        port.stop()


def test_preamble_round_trips_and_refuses_bad_tokens() -> None:
    line = token_preamble("abc-DEF_123")
    assert line.endswith(b"\n") and parse_preamble(line[:-1]) == b"abc-DEF_123"
    assert parse_preamble(b"CUBE-WORKLOAD-TOKEN ") is None and parse_preamble(b"garbage") is None
    for bad in ("", "has space", "new\nline", "x" * 300):
        with pytest.raises(ValueError):
            token_preamble(bad)


def test_the_token_from_the_channel_is_the_one_the_service_checks(
    bridged: tuple[WorkloadBridge, WorkloadClient], tmp_path: Path
) -> None:
    _, wl = bridged
    assert stat.S_IMODE((tmp_path / "workload.sock").stat().st_mode) == 0o600
    assert wl.run("echo hi").output() == b"hi\n"
    r = wl.unary("process.Process/List", {}, token="not-the-token")
    assert r.status_code == 401


def test_concurrent_streams_and_megabytes_through_the_bridge(bridged: tuple[WorkloadBridge, WorkloadClient]) -> None:
    bridge, wl = bridged
    results: dict[int, int] = {}

    def one(i: int) -> None:
        s = wl.run(f"head -c {2 * MiB} /dev/zero")
        results[i] = len(s.output())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == {i: 2 * MiB for i in range(8)}
    assert bridge.connections >= 1


def test_a_service_that_never_answers_fails_the_start_with_a_workload_code(tmp_path: Path) -> None:
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.bind(str(tmp_path / "vmm.sock"))
    silent.listen(1)  # accepts (the kernel does) but nothing ever reads or answers
    bridge = WorkloadBridge(tmp_path / "vmm.sock", tmp_path / "w.sock", "tok")
    bridge.start(5)
    try:
        with pytest.raises(CubeError) as err:
            bridge.wait_healthy(1.0)
        assert err.value.code == "workload.not_up" and err.value.layer == "workload"
    finally:
        bridge.close()
        silent.close()


def test_nothing_listens_where_no_vmm_is(tmp_path: Path) -> None:
    with pytest.raises(CubeError) as err:
        WorkloadBridge(tmp_path / "absent.sock", tmp_path / "w.sock", "tok").start(0.2)
    assert err.value.code == "workload.channel_unreachable"
