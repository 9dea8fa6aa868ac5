"""A warm claim's rebind of the shim's bridge to the tenant's token (docs/warm.md), against the real guest service.

A pseudo-terminal in raw mode stands in for the guest's virtio port: the real `cube-workload serve --mux-port`
keeps it open across sessions, as in a guest; a unix socket stands in for the VMM's chardev, relayed to the
terminal's other side. The rebind is done in place (GOAWAY and PING in one write, the preamble only after the
guest's answer); a guest that cannot take it in place is reconnected to instead.
"""

from __future__ import annotations

import contextlib
import os
import pty
import secrets
import socket
import subprocess
import sys
import threading
import time
import tty
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cubeaccel.shim import workload_bridge
from cubeaccel.shim.warm_control import warm_up
from cubeaccel.shim.workload_bridge import WorkloadBridge
from tests.unit.test_workload_bridge_recovery import RespawningPort, echo
from tests.workload_client import ROOT, WorkloadClient


class TerminalPort:
    """The guest's port is a raw pty that outlives host connections; each connection to the VMM socket is
    relayed to it (a new connection replaces the old, as QEMU's chardev takes one client)."""

    def __init__(self, path: Path) -> None:
        self.master, self.slave = pty.openpty()  # the slave held open: a master whose slave is closed reads EIO
        tty.setraw(self.slave)
        self.slave_path = os.ttyname(self.slave)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(4)
        self.conn: socket.socket | None = None
        self.connections = 0
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        cmd = [
            sys.executable,
            "-m",
            "cubeaccel.workload",
            "serve",
            "--mux-port",
            self.slave_path,
            "--token-from-channel",
        ]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        threading.Thread(target=self._accept, daemon=True).start()
        threading.Thread(target=self._to_host, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            old, self.conn = self.conn, conn
            self.connections += 1
            if old is not None:
                old.close()
            threading.Thread(target=self._to_guest, args=(conn,), daemon=True).start()

    def _to_guest(self, conn: socket.socket) -> None:
        try:
            while data := conn.recv(65536):
                os.write(self.master, data)
        except OSError:
            pass

    def _to_host(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:
                return
            if self.conn is not None:
                with contextlib.suppress(OSError):
                    self.conn.sendall(data)

    def stop(self) -> None:
        self.sock.close()
        self.proc.terminate()
        self.proc.wait(10)
        os.close(self.master)
        os.close(self.slave)


WARM_TOKEN = secrets.token_urlsafe(32)  # a warm sandbox's own (unknowable_token's kind)


@pytest.fixture
def terminal(tmp_path: Path) -> Iterator[tuple[TerminalPort, WorkloadBridge, httpx.Client]]:
    port = TerminalPort(tmp_path / "vmm.sock")
    bridge = WorkloadBridge(tmp_path / "vmm.sock", tmp_path / "workload.sock", WARM_TOKEN)
    http = httpx.Client(
        transport=httpx.HTTPTransport(uds=str(tmp_path / "workload.sock")), base_url="http://w", timeout=60
    )
    try:
        bridge.start(10)
        bridge.wait_healthy(30)
        yield port, bridge, http
    finally:
        http.close()
        bridge.close()
        port.stop()


def test_a_rebind_is_done_in_place_and_only_the_new_token_is_served_after_it(
    terminal: tuple[TerminalPort, WorkloadBridge, httpx.Client], monkeypatch: pytest.MonkeyPatch
) -> None:
    port, bridge, http = terminal
    monkeypatch.setattr(workload_bridge, "RECONNECT_PAUSE_S", 60.0)  # a reconnect would fail the deadline below
    tenant = secrets.token_urlsafe(32)
    refused = WorkloadClient(http, tenant).collect(
        "process.Process/Start", {"process": {"cmd": "/bin/echo", "args": ["x"]}}
    )
    assert refused.error is not None and refused.error["code"] == "unauthenticated"
    t0 = time.monotonic()
    bridge.rebind(tenant, 30)
    assert time.monotonic() - t0 < 30
    assert (bridge.in_place_rebinds, bridge.sessions, port.connections) == (1, 2, 1)  # no reconnect
    assert echo(WorkloadClient(http, tenant), "tenant") == b"tenant\n"
    other = WorkloadClient(http, secrets.token_urlsafe(32)).collect(
        "process.Process/Start", {"process": {"cmd": "/bin/echo", "args": ["x"]}}
    )
    assert other.error is not None and other.error["code"] == "unauthenticated"
    assert port.proc.poll() is None  # the guest service never saw a broken session


def test_a_guest_that_cannot_serve_a_second_session_in_place_is_reconnected_to(tmp_path: Path) -> None:
    """A service on an inherited fd (`--mux-fd`) answers the PING and exits after the GOAWAY: the new session
    never answers /health, and the supervisor's reconnect (a new service, as a restarted guest's) serves it."""
    port = RespawningPort(tmp_path / "vmm.sock")
    bridge = WorkloadBridge(tmp_path / "vmm.sock", tmp_path / "workload.sock", secrets.token_urlsafe(32))
    http = httpx.Client(
        transport=httpx.HTTPTransport(uds=str(tmp_path / "workload.sock")), base_url="http://w", timeout=60
    )
    try:
        bridge.start(10)
        bridge.wait_healthy(30)
        tenant = secrets.token_urlsafe(32)
        bridge.rebind(tenant, 60)
        assert bridge.in_place_rebinds == 0 and len(port.procs) == 2
        assert echo(WorkloadClient(http, tenant), "reconnected") == b"reconnected\n"
    finally:
        http.close()
        bridge.close()
        port.stop()


def test_the_warm_up_runs_a_login_shell_under_the_warm_token_only_and_leaves_no_listed_process(
    terminal: tuple[TerminalPort, WorkloadBridge, httpx.Client],
) -> None:
    _, bridge, http = terminal
    assert warm_up(bridge, secrets.token_urlsafe(32)) is False  # any other token is refused, as a tenant's is
    assert warm_up(bridge, WARM_TOKEN) is True
    tenant = secrets.token_urlsafe(32)
    bridge.rebind(tenant, 30)
    listed = WorkloadClient(http, tenant).ok("process.Process/List", {})
    assert listed.get("processes", []) == []
