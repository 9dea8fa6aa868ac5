"""The shim's bridge when the guest side misbehaves or goes away (issue 12, hostile workloads and recovery).

A unix socket stands in for the VMM's virtserialport chardev, as in test_workload_bridge.py. Here each connection
gets its own real service (`--mux-fd`), so a service that dies or restarts is replaced the way the guest's init
replaces it; or a scripted fake guest speaks raw mux frames to flood or to stop mid-stream.
"""

from __future__ import annotations

import os
import resource
import secrets
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from cubeaccel.protocol.mux import Frame, FrameType, ResetCode, Session, data_frame, token_preamble
from cubeaccel.shim import workload_bridge
from cubeaccel.shim.workload_bridge import WorkloadBridge
from cubeaccel.workload.__main__ import read_preamble
from tests.support.poll import poll
from tests.workload_client import ROOT, WorkloadClient

MiB = 1024 * 1024


def echo(wl: WorkloadClient, text: str) -> bytes:
    """`/bin/echo TEXT` run directly (not `bash -l`: a login shell on a shared host may stall in its profile)."""
    body = {"process": {"cmd": "/bin/echo", "args": [text]}, "stdin": False}
    return wl.collect("process.Process/Start", body).output()


class RespawningPort:
    """Listens where the VMM would; every connection gets a new service process (the guest init's restart)."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(4)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.conns: list[socket.socket] = []  # our end of each connection, kept (a port stays open on a restart)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            self.spawn(conn)

    def spawn(self, conn: socket.socket) -> None:
        fd = os.dup(conn.fileno())
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        cmd = [sys.executable, "-m", "cubeaccel.workload", "serve", "--mux-fd", str(fd), "--token-from-channel"]
        self.procs.append(subprocess.Popen(cmd, pass_fds=(fd,), env=env, stdout=subprocess.DEVNULL))
        os.close(fd)

    def stop(self) -> None:
        self.sock.close()
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(10)
        for conn in self.conns:
            conn.close()


@pytest.fixture
def respawning(tmp_path: Path) -> Iterator[tuple[RespawningPort, WorkloadBridge, WorkloadClient]]:
    port = RespawningPort(tmp_path / "vmm.sock")
    token = secrets.token_urlsafe(24)
    bridge = WorkloadBridge(tmp_path / "vmm.sock", tmp_path / "workload.sock", token)
    bridge.start(10)
    bridge.wait_healthy(30)
    http = httpx.Client(
        transport=httpx.HTTPTransport(uds=str(tmp_path / "workload.sock")), base_url="http://w", timeout=60
    )
    try:
        yield port, bridge, WorkloadClient(http, token)
    finally:
        http.close()
        bridge.close()
        port.stop()


def test_a_service_that_dies_is_reached_again_after_the_bridge_reconnects(
    respawning: tuple[RespawningPort, WorkloadBridge, WorkloadClient],
) -> None:
    port, bridge, wl = respawning
    assert echo(wl, "first") == b"first\n"
    first = port.procs[0]
    first.send_signal(signal.SIGKILL)  # the service dies; its end of the channel closes (EOF at the bridge)
    first.wait(10)
    port.conns[0].close()
    poll(lambda: bridge.sessions >= 2 and not bridge.ended, 30, what="the bridge reconnected")
    assert echo(wl, "again") == b"again\n"
    assert len(port.procs) == 2


def test_a_restarted_service_that_says_goaway_gets_a_new_session(
    respawning: tuple[RespawningPort, WorkloadBridge, WorkloadClient],
) -> None:
    """A virtio port shows the host no close when the guest service restarts: the connection stays up, and the
    new service's GOAWAY is the only sign. The bridge must start a new session on it, not wait for EOF."""
    port, bridge, wl = respawning
    assert echo(wl, "first") == b"first\n"
    port.procs[0].send_signal(signal.SIGKILL)
    port.procs[0].wait(10)
    goaway = Session(client=False)
    goaway.go_away()
    port.conns[0].sendall(goaway.data_to_send())  # the connection stays open, as QEMU's would
    poll(lambda: bridge.sessions >= 2 and not bridge.ended, 30, what="a new session after GOAWAY")
    assert echo(wl, "again") == b"again\n"


def test_the_guest_finds_the_preamble_after_frames_of_a_stale_session() -> None:
    r, w = os.pipe()
    try:
        stale = Frame(FrameType.OPEN, 7).encode() + data_frame(7, b"POST /x HTTP/1.1\r\n\r\nCUBE-WORK").encode()
        os.write(w, stale + token_preamble("the-new-token"))
        assert read_preamble(r, threading.Event()) == b"the-new-token"
    finally:
        os.close(r)
        os.close(w)


class ScriptedGuest:
    """A fake guest on the VMM socket: reads the preamble, then runs `script(conn)` once the host opens stream 1."""

    def __init__(self, path: Path, script: Callable[[socket.socket], None]) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(4)
        self.script = script
        self.sessions = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.sessions += 1
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        try:
            buf = b""
            while len(buf) < 12 + 64:  # preamble + the OPEN of stream 1 (and maybe its request)
                ready, _, _ = select.select([conn], [], [], 10)
                if not ready or not (chunk := conn.recv(4096)):
                    return
                buf += chunk
            self.script(conn)
        except OSError:
            pass

    def stop(self) -> None:
        self.sock.close()


def _rss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


@pytest.mark.parametrize("flood", ["data_beyond_window", "pings_unread"])
def test_a_flooding_guest_is_cut_off_with_bounded_host_memory(tmp_path: Path, flood: str) -> None:
    stop = threading.Event()

    def script(conn: socket.socket) -> None:
        if flood == "data_beyond_window":
            chunk = data_frame(1, b"x" * 65536).encode()  # stream 1's window is 256 KiB; this never stops
        else:
            chunk = Frame(FrameType.PING, 0, length=1).encode() * 4096  # and we never read the answers
        while not stop.is_set():
            conn.sendall(chunk)

    guest = ScriptedGuest(tmp_path / "vmm.sock", script)
    monkey = pytest.MonkeyPatch()
    monkey.setattr(workload_bridge, "RECONNECT_PAUSE_S", 60.0)  # one session is enough to judge
    bridge = WorkloadBridge(tmp_path / "vmm.sock", tmp_path / "w.sock", "tok")
    rss_before = _rss_kib()
    try:
        bridge.start(5)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(tmp_path / "w.sock"))
            client.sendall(b"GET /health HTTP/1.1\r\nHost: w\r\n\r\n")
            client.settimeout(30)
            while client.recv(65536):  # what the guest had credit for passes; then the connection is closed
                pass
        poll(lambda: bridge.ended, 30, what="the session was cut off")
        expected = "mux.window_exceeded" if flood == "data_beyond_window" else "mux.flood"
        assert getattr(bridge.error, "code", None) == expected, bridge.error
        assert _rss_kib() - rss_before < 64 * 1024  # bounded: nothing like the flood was held
    finally:
        stop.set()
        bridge.close()
        guest.stop()
        monkey.undo()


def test_a_guest_that_closes_mid_stream_ends_the_clients_connection_and_is_reconnected(tmp_path: Path) -> None:
    def script(conn: socket.socket) -> None:
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/connect+json\r\nTransfer-Encoding: chunked\r\n\r\n"
        conn.sendall(data_frame(1, head + b"5\r\nabcde\r\n").encode())
        conn.close()  # mid-stream: no end-of-stream envelope, no last chunk

    guest = ScriptedGuest(tmp_path / "vmm.sock", script)
    bridge = WorkloadBridge(tmp_path / "vmm.sock", tmp_path / "w.sock", "tok")
    try:
        bridge.start(5)
        http = httpx.Client(transport=httpx.HTTPTransport(uds=str(tmp_path / "w.sock")), base_url="http://w")
        with pytest.raises(httpx.RemoteProtocolError), http.stream("POST", "/x", content=b"{}") as r:
            for _ in r.iter_raw():
                pass
        poll(lambda: guest.sessions >= 2, 30, what="the bridge reconnected after the close")
        http.close()
    finally:
        bridge.close()
        guest.stop()


def test_streams_the_guest_opens_are_refused(tmp_path: Path) -> None:
    seen: list[bytes] = []

    def script(conn: socket.socket) -> None:
        conn.sendall(Frame(FrameType.OPEN, 2).encode() + data_frame(2, b"hello host").encode())
        conn.settimeout(5)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            data = conn.recv(4096)
            if not data:
                return
            seen.append(data)
            if Frame(FrameType.RESET, 2, length=ResetCode.REFUSED).encode() in b"".join(seen):
                return

    guest = ScriptedGuest(tmp_path / "vmm.sock", script)
    bridge = WorkloadBridge(tmp_path / "vmm.sock", tmp_path / "w.sock", "tok")
    try:
        bridge.start(5)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(tmp_path / "w.sock"))
            client.sendall(b"GET /health HTTP/1.1\r\nHost: w\r\n\r\n")
            poll(
                lambda: Frame(FrameType.RESET, 2, length=ResetCode.REFUSED).encode() in b"".join(seen),
                15,
                what="the guest's stream was refused",
            )
    finally:
        bridge.close()
        guest.stop()


class OneServicePort(RespawningPort):
    """A port whose service, once gone, is not restarted until `restart` is set (a guest out of memory: the OOM
    killer took the service and init cannot bring it back). Its end stays open, as a virtio port's does."""

    def __init__(self, path: Path) -> None:
        self.restart = False
        super().__init__(path)

    def spawn(self, conn: socket.socket) -> None:
        if not self.procs or self.restart:
            super().spawn(conn)


def test_a_service_that_stops_answering_is_reported_by_name_and_calls_fail_instead_of_hanging(
    tmp_path: Path,
) -> None:
    port = OneServicePort(tmp_path / "vmm.sock")
    token = secrets.token_urlsafe(24)
    told: list[tuple[bool, str]] = []
    bridge = WorkloadBridge(
        tmp_path / "vmm.sock",
        tmp_path / "workload.sock",
        token,
        on_health=lambda answering, why: told.append((answering, why)),
        unresponsive_after_s=1.0,
        ping_every_s=0.2,
    )
    bridge.start(10)
    bridge.wait_healthy(30)
    http = httpx.Client(
        transport=httpx.HTTPTransport(uds=str(tmp_path / "workload.sock")), base_url="http://w", timeout=60
    )
    wl = WorkloadClient(http, token)
    try:
        assert echo(wl, "first") == b"first\n"
        port.procs[0].send_signal(signal.SIGKILL)  # gone, and nothing closes the channel
        port.procs[0].wait(10)
        t0 = time.monotonic()
        with pytest.raises(httpx.HTTPError):  # the call in flight ends with its connection closed
            echo(wl, "in flight")
        assert time.monotonic() - t0 < 30
        poll(lambda: told == [(False, told[0][1])] if told else False, 30, what="the bridge said the service is gone")
        refused = http.post("/process.Process/Start", json={})
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "workload.unresponsive"
        port.restart = True  # the service comes back: the next reconnect finds it
        poll(lambda: len(told) == 2, 60, what="the bridge said the service answers again")
        assert told[1][0] is True and bridge.unresponsive_since is None
        assert echo(wl, "again") == b"again\n"
    finally:
        http.close()
        bridge.close()
        port.stop()
