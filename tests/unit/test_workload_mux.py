"""cube-workload served over the mux framing on one byte channel (a socketpair standing in for virtio-serial).

The guest is the real `python -m cubeaccel.workload serve --mux-fd` process; the host side is `MuxChannel` in
the test, each HTTP request on its own mux stream, many at once, with 256 KiB windows exercised by MiBs of data.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cubeaccel.workload.connect import EnvelopeDecoder, encode_envelope
from cubeaccel.workload.http1 import Connection
from cubeaccel.workload.muxchannel import MuxChannel
from tests.workload_client import ROOT

MiB = 1024 * 1024


class _Sock:
    """What http.client.HTTPResponse needs from a socket: makefile()."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def makefile(self, mode: str) -> Any:
        return self.conn.reader


@dataclass
class Host:
    channel: MuxChannel
    token: str
    proc: subprocess.Popen[bytes]

    def request(
        self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        conn = self.channel.open()
        try:
            hdrs = {
                "Host": "workload",
                "X-Access-Token": self.token,
                "Content-Length": str(len(body)),
                **(headers or {}),
            }
            head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items()) + "\r\n"
            conn.writer.write(head.encode() + body)
            conn.writer.flush()
            resp = http.client.HTTPResponse(_Sock(conn))  # type: ignore[arg-type]
            resp.begin()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def start(self, script: str) -> list[dict[str, Any]]:
        body = encode_envelope({"process": {"cmd": "/bin/sh", "args": ["-c", script]}, "stdin": False})
        status, headers, data = self.request(
            "POST", "/process.Process/Start", body, {"Content-Type": "application/connect+json"}
        )
        assert status == 200 and headers["content-type"] == "application/connect+json"
        return [e.message() for e in EnvelopeDecoder(16 * MiB).feed(data)]


def stdout_of(messages: list[dict[str, Any]]) -> bytes:
    return b"".join(
        base64.b64decode(m["event"]["data"]["stdout"])
        for m in messages
        if "stdout" in m.get("event", {}).get("data", {})
    )


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Host]:
    token = secrets.token_urlsafe(16)
    (tmp_path / "token").write_text(token)
    guest_end, host_end = socket.socketpair()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cubeaccel.workload",
            "serve",
            "--mux-fd",
            str(guest_end.fileno()),
            "--token-file",
            str(tmp_path / "token"),
        ],
        pass_fds=[guest_end.fileno()],
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        stderr=(tmp_path / "stderr").open("wb"),
    )
    guest_end.close()
    channel = MuxChannel(host_end.fileno(), host_end.fileno(), client=True)
    try:
        yield Host(channel, token, proc)
    finally:
        channel.close()
        host_end.close()
        try:
            proc.wait(10)  # the channel's end is the guest's end
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def test_health_and_a_command_over_the_mux(host: Host) -> None:
    assert host.request("GET", "/health")[0] == 204
    messages = host.start("echo over the mux; exit 2")
    assert stdout_of(messages) == b"over the mux\n"
    assert messages[-2]["event"]["end"]["exitCode"] == 2 and messages[-1] == {}


def test_megabytes_both_ways_on_concurrent_streams(host: Host, tmp_path: Path) -> None:
    blob = os.urandom(3 * MiB)
    src = tmp_path / "src.bin"
    src.write_bytes(blob)
    results: dict[str, Any] = {}

    def download(i: int) -> None:
        status, _, data = host.request("GET", f"/files?path={src}", headers={"Accept-Encoding": "identity"})
        results[f"down{i}"] = (status, hashlib.sha256(data).hexdigest())

    def upload(i: int) -> None:
        dest = tmp_path / f"up{i}.bin"
        status, _, _ = host.request("POST", f"/files?path={dest}", blob, {"Content-Type": "application/octet-stream"})
        results[f"up{i}"] = (status, hashlib.sha256(dest.read_bytes()).hexdigest())

    def command(i: int) -> None:
        results[f"cmd{i}"] = (200, hashlib.sha256(stdout_of(host.start(f"cat {src}"))).hexdigest())

    threads = [threading.Thread(target=f, args=(i,)) for i in range(3) for f in (download, upload, command)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    want = hashlib.sha256(blob).hexdigest()
    assert results == {f"{kind}{i}": (200, want) for i in range(3) for kind in ("down", "up", "cmd")}
    assert host.channel.error is None


def test_a_host_speaking_garbage_ends_the_guest_session(host: Host) -> None:
    assert host.request("GET", "/health")[0] == 204
    os.write(host.channel.wfd, b"\x07" * 64)  # not a frame: version 7
    deadline = time.monotonic() + 20
    while host.proc.poll() is None:
        assert time.monotonic() < deadline, "guest kept serving a channel it cannot parse"
        time.sleep(0.02)
    assert host.proc.returncode == 0


def test_unauthenticated_over_the_mux(host: Host) -> None:
    status, _, body = host.request(
        "POST", "/process.Process/List", b"{}", {"Content-Type": "application/json", "X-Access-Token": "nope"}
    )
    assert status == 401 and json.loads(body)["code"] == "unauthenticated"


def test_the_host_vanishing_mid_stream_ends_the_guest_and_its_commands(host: Host, tmp_path: Path) -> None:
    pidfile = tmp_path / "cmd.pid"
    conn = host.channel.open()
    body = encode_envelope({"process": {"cmd": "/bin/sh", "args": ["-c", f"echo $$ > {pidfile}; exec sleep 1000"]}})
    head = (
        f"POST /process.Process/Start HTTP/1.1\r\nHost: w\r\nX-Access-Token: {host.token}\r\n"
        f"Content-Type: application/connect+json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    conn.writer.write(head.encode() + body)
    conn.writer.flush()
    deadline = time.monotonic() + 20
    while not pidfile.exists() or not pidfile.read_text().strip():
        assert time.monotonic() < deadline, "command did not start"
        time.sleep(0.02)
    pid = int(pidfile.read_text())
    with socket.socket(fileno=os.dup(host.channel.rfd)) as sock:
        sock.shutdown(socket.SHUT_RDWR)  # the channel drops mid-stream
    while host.proc.poll() is None or _state(pid) != "Z":  # the guest exits and SIGKILLs the command's group
        assert time.monotonic() < deadline + 20, "guest or its command outlived the channel"
        time.sleep(0.02)


def _state(pid: int) -> str:
    """The process state letter; a reaped (gone) process counts as a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "Z"
