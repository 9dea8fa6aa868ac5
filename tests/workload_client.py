"""A test client for cube-workload: starts the real service as a subprocess and speaks Connect+JSON with httpx.

Kept apart from the tests so the benchmark can reuse it. Only processes it started are ever signalled (by pid).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from cubeaccel.workload.connect import FLAG_END_STREAM, EnvelopeDecoder, encode_envelope

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Stream:
    """A server-streaming call's events as they arrive, and its end-of-stream error (None for success)."""

    events: list[dict[str, Any]] = field(default_factory=list)
    error: dict[str, Any] | None = None
    trailer_seen: bool = False

    def kinds(self) -> list[str]:
        return [next(iter(e["event"])) for e in self.events]

    def output(self, kind: str = "stdout") -> bytes:
        return b"".join(
            base64.b64decode(e["event"]["data"][kind]) for e in self.events if kind in e["event"].get("data", {})
        )

    @property
    def end(self) -> dict[str, Any]:
        ends = [e["event"]["end"] for e in self.events if "end" in e["event"]]
        assert len(ends) == 1, self.kinds()
        end: dict[str, Any] = ends[0]
        return end

    @property
    def pid(self) -> int:
        return int(self.events[0]["event"]["start"]["pid"])


@dataclass
class WorkloadClient:
    http: httpx.Client
    token: str

    def headers(self, extra: dict[str, str] | None = None, token: str | None = None) -> dict[str, str]:
        h = {"X-Access-Token": self.token if token is None else token, "Connect-Protocol-Version": "1"}
        return {**h, **(extra or {})}

    def unary(self, method: str, body: dict[str, Any], token: str | None = None, **hdrs: str) -> httpx.Response:
        return self.http.post(
            f"/{method}",
            content=json.dumps(body),
            headers=self.headers({"Content-Type": "application/json", **hdrs}, token),
        )

    def ok(self, method: str, body: dict[str, Any], **hdrs: str) -> dict[str, Any]:
        r = self.unary(method, body, **hdrs)
        assert r.status_code == 200, r.text
        result: dict[str, Any] = r.json()
        return result

    @contextmanager
    def stream(
        self, method: str, body: dict[str, Any], token: str | None = None, headers: dict[str, str] | None = None
    ) -> Iterator[Iterator[dict[str, Any]]]:
        """Yields an iterator of messages; the end-of-stream envelope ends it (its error is raised as the value)."""
        envelope = encode_envelope(body)

        def chunks() -> Iterator[bytes]:  # a generator body: httpx sends it chunked, like the SDK
            yield envelope[:3]
            yield envelope[3:]

        hdrs = {"Content-Type": "application/connect+json", "Keepalive-Ping-Interval": "50", **(headers or {})}
        with self.http.stream("POST", f"/{method}", content=chunks(), headers=self.headers(hdrs, token)) as r:
            assert r.status_code == 200, r.read()
            assert r.headers["content-type"] == "application/connect+json"

            def messages() -> Iterator[dict[str, Any]]:
                decoder = EnvelopeDecoder(max_message=16 * 1024 * 1024)
                for data in r.iter_raw():
                    for env in decoder.feed(data):
                        msg = env.message()
                        if env.flags & FLAG_END_STREAM:
                            yield {"__end__": msg}
                            return
                        yield msg
                raise AssertionError("stream ended without an end-of-stream envelope")

            yield messages()

    def collect(self, method: str, body: dict[str, Any], **kw: Any) -> Stream:
        out = Stream()
        with self.stream(method, body, **kw) as messages:
            for msg in messages:
                if "__end__" in msg:
                    out.error, out.trailer_seen = msg["__end__"].get("error"), True
                else:
                    out.events.append(msg)
        return out

    def run(self, script: str, *, timeout_ms: int | None = None, user: str | None = None, **process: Any) -> Stream:
        """What the E2B SDK sends for `commands.run(script)`."""
        headers = {"Connect-Timeout-Ms": str(timeout_ms)} if timeout_ms else {}
        if user is not None:
            headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:".encode()).decode()
        body = {"process": {"cmd": "/bin/bash", "args": ["-l", "-c", script], **process}, "stdin": False}
        return self.collect("process.Process/Start", body, headers=headers)


@dataclass
class ServerProcess:
    proc: subprocess.Popen[bytes]
    socket_path: Path
    token: str

    def client(self, timeout: float = 60.0) -> WorkloadClient:
        transport = httpx.HTTPTransport(uds=str(self.socket_path))
        http = httpx.Client(transport=transport, base_url="http://workload", timeout=timeout)
        return WorkloadClient(http, self.token)

    def rss_kib(self, field_name: str = "VmHWM") -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
        raise AssertionError(field_name)


@contextmanager
def workload_server(tmp: Path, *extra: str) -> Iterator[ServerProcess]:
    token = secrets.token_urlsafe(24)
    token_file = tmp / "token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    sock = tmp / "workload.sock"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    stderr = (tmp / "workload.stderr").open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cubeaccel.workload",
            "serve",
            "--unix",
            str(sock),
            "--token-file",
            str(token_file),
            *extra,
        ],
        env=env,
        stderr=stderr,
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while b"serving on" not in (tmp / "workload.stderr").read_bytes():
            assert proc.poll() is None, (tmp / "workload.stderr").read_text()
            assert time.monotonic() < deadline, "workload service did not start"
            time.sleep(0.02)
        yield ServerProcess(proc, sock, token)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        stderr.close()


class MuxTcpProxy:
    """What the shim will do, for tests: each TCP connection accepted here becomes one mux stream to the guest."""

    def __init__(self, channel: Any) -> None:
        import socket
        import threading

        self.channel = channel
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading

        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            stream = self.channel.open()
            threading.Thread(target=self._up, args=(client, stream), daemon=True).start()
            threading.Thread(target=self._down, args=(client, stream), daemon=True).start()

    @staticmethod
    def _up(client: Any, stream: Any) -> None:
        try:
            while data := client.recv(65536):
                stream.writer.write(data)
                stream.writer.flush()
        except OSError:
            pass
        finally:
            stream.close()

    @staticmethod
    def _down(client: Any, stream: Any) -> None:
        import socket

        try:
            while data := stream.reader.read1(65536):
                client.sendall(data)
        except (OSError, ValueError):
            pass
        finally:
            with contextlib.suppress(OSError):
                client.shutdown(socket.SHUT_RDWR)
            client.close()

    def close(self) -> None:
        self.sock.close()
