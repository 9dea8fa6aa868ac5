"""Host-side client of a sandbox's workload service (envd's protocol), through Cubelet's proxy or a shim socket.

Envelopes are the shared codec's (`model/connect_envelope.py`, which the guest's Connect codec uses too).
Used by `cubeaccel sandbox exec/cp` and `make demo`.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import httpx

from cubeaccel.model import connect_envelope
from cubeaccel.model.errors import CubeError

END_STREAM = connect_envelope.FLAG_END_STREAM
MAX_MESSAGE = 16 * 1024 * 1024
CHUNK = 256 * 1024


def envelope(message: dict[str, Any], flags: int = 0) -> bytes:
    return connect_envelope.encode_json(message, flags)


def envelopes(chunks: Iterable[bytes]) -> Iterator[tuple[int, dict[str, Any]]]:
    """(flags, message) for each envelope in a byte stream cut anywhere."""
    decoder = connect_envelope.EnvelopeDecoder(MAX_MESSAGE)
    try:
        for chunk in chunks:
            for e in decoder.feed(chunk):
                msg = json.loads(e.payload or b"{}")
                yield e.flags, msg if isinstance(msg, dict) else {}
        decoder.finish()
    except connect_envelope.EnvelopeError as e:
        raise workload_error("workload.bad_reply", f"from the workload service: {e}") from None


def workload_error(code: str, message: str, **details: object) -> CubeError:
    return CubeError(code, message, "workload", dict(details), 502)


@dataclass
class ExecResult:
    exit_code: int
    status: str
    pid: int | None


class WorkloadClient:
    """One sandbox's workload API at `base_url` (`…/v1/sandboxes/SB/workload` or `http://workload` on a socket)."""

    def __init__(self, http: httpx.Client, token: str) -> None:
        self.http = http
        self.token = token

    @classmethod
    def over(cls, base_url: str, token: str, uds: str | None = None, timeout: float | None = None) -> WorkloadClient:
        transport = httpx.HTTPTransport(uds=uds) if uds else None
        http = httpx.Client(base_url=base_url, transport=transport, timeout=httpx.Timeout(timeout, connect=10.0))
        return cls(http, token)

    def headers(self, user: str | None = None, **extra: str) -> dict[str, str]:
        h = {"X-Access-Token": self.token, "Connect-Protocol-Version": "1", **extra}
        if user:
            h["Authorization"] = "Basic " + base64.b64encode(f"{user}:".encode()).decode()
        return h

    def unary(self, method: str, body: dict[str, Any], user: str | None = None) -> dict[str, Any]:
        r = self.http.post(
            f"/{method}", content=json.dumps(body), headers=self.headers(user, **{"Content-Type": "application/json"})
        )
        if r.status_code != 200:
            raise _reply_error(r.status_code, r.content)
        out = r.json()
        return out if isinstance(out, dict) else {}

    def exec(
        self,
        cmd: list[str],
        *,
        envs: dict[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        timeout_s: float | None = None,
        stdin: BinaryIO | None = None,
        on_stdout: Callable[[bytes], None] = lambda b: None,
        on_stderr: Callable[[bytes], None] = lambda b: None,
    ) -> ExecResult:
        """Start `cmd`, stream its output to the callbacks as it comes, feed `stdin` (then close it)."""
        process: dict[str, Any] = {"cmd": cmd[0], "args": cmd[1:]}
        if envs:
            process["envs"] = envs
        if cwd:
            process["cwd"] = cwd
        extra = {"Content-Type": "application/connect+json"}
        if timeout_s:
            extra["Connect-Timeout-Ms"] = str(int(timeout_s * 1000))
        body = envelope({"process": process, "stdin": stdin is not None})
        pid: int | None = None
        result: ExecResult | None = None
        with self.http.stream("POST", "/process.Process/Start", content=body, headers=self.headers(user, **extra)) as r:
            if r.status_code != 200:
                raise _reply_error(r.status_code, r.read())
            for flags, msg in envelopes(r.iter_raw()):
                if flags & END_STREAM:
                    if msg.get("error"):
                        err = msg["error"]
                        raise workload_error(
                            "workload.refused", str(err.get("message", "")), connect_code=err.get("code")
                        )
                    break
                event = msg.get("event", {})
                if "start" in event:
                    pid = int(event["start"]["pid"])
                    if stdin is not None:
                        self._feed_stdin(pid, stdin)
                elif "data" in event:
                    data = event["data"]
                    if "stdout" in data:
                        on_stdout(base64.b64decode(data["stdout"]))
                    if "stderr" in data:
                        on_stderr(base64.b64decode(data["stderr"]))
                elif "end" in event:
                    end = event["end"]
                    status = str(end.get("status", ""))
                    code = int(end.get("exitCode", 0))
                    if code < 0 or status.startswith("signal"):
                        code = 128 + (9 if "killed" in status else 15)
                    result = ExecResult(code, status, pid)
            else:
                raise workload_error("workload.bad_reply", "the command's stream ended without an end-of-stream")
        if result is None:
            raise workload_error("workload.bad_reply", "the command's stream has no end event")
        return result

    def _feed_stdin(self, pid: int, stdin: BinaryIO) -> None:
        """Feed `stdin` from a daemon thread, which may still be blocked reading when the command has ended. A
        stream with a file descriptor is read with os.read: a thread blocked inside a buffered reader holds its
        lock, and the interpreter aborts (SIGABRT) when it cannot take that lock at exit."""
        import threading

        try:
            fd: int | None = stdin.fileno()
        except (AttributeError, OSError, ValueError):
            fd = None

        def read() -> bytes:
            if fd is not None:
                return os.read(fd, 64 * 1024)
            return stdin.read1(64 * 1024) if hasattr(stdin, "read1") else stdin.read(64 * 1024)

        def pump() -> None:
            try:
                while chunk := read():
                    data = base64.b64encode(chunk).decode()
                    self.unary("process.Process/SendInput", {"process": {"pid": pid}, "input": {"stdin": data}})
                self.unary("process.Process/CloseStdin", {"process": {"pid": pid}})
            except (CubeError, httpx.HTTPError, OSError, ValueError):
                pass  # the command ended first

        threading.Thread(target=pump, daemon=True, name="exec stdin").start()

    def upload(self, path: str, src: BinaryIO, user: str | None = None) -> None:
        def chunks() -> Iterator[bytes]:
            while chunk := src.read(CHUNK):
                yield chunk

        params = {"path": path, **({"username": user} if user else {})}
        r = self.http.post(
            "/files",
            params=params,
            content=chunks(),
            headers=self.headers(None, **{"Content-Type": "application/octet-stream"}),
        )
        if r.status_code != 200:
            raise _reply_error(r.status_code, r.content)

    def download(self, path: str, dst: BinaryIO, user: str | None = None) -> int:
        params = {"path": path, **({"username": user} if user else {})}
        n = 0
        with self.http.stream(
            "GET", "/files", params=params, headers=self.headers(None, **{"Accept-Encoding": "identity"})
        ) as r:
            if r.status_code != 200:
                raise _reply_error(r.status_code, r.read())
            for chunk in r.iter_raw():
                dst.write(chunk)
                n += len(chunk)
        return n

    def close(self) -> None:
        self.http.close()


def _reply_error(status: int, body: bytes) -> CubeError:
    """A Cubelet error body (`{"error": {code, layer, …}}`), a Connect error (`{code, message}`) or envd's."""
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
        e = doc["error"]
        return CubeError(str(e.get("code")), str(e.get("message", "")), str(e.get("layer", "api")), {}, status)
    if isinstance(doc, dict) and "message" in doc:
        return workload_error("workload.refused", str(doc["message"]), connect_code=doc.get("code"), status=status)
    return workload_error("workload.bad_reply", f"HTTP {status}: {body[:200]!r}", status=status)
