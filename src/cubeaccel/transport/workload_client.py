"""Host-side client of a sandbox's workload service (envd's protocol), through Cubelet's proxy or a shim socket.

Envelopes are the shared codec's (`protocol/connect_envelope.py`) and messages the shared models
(`protocol/envd_process.py`), which the guest's service uses too. Used by `cubeaccel sandbox exec/cp` and `make demo`.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import BinaryIO, Protocol, TypeVar

import httpx

from cubeaccel.protocol import connect_envelope
from cubeaccel.protocol import proto_json as pj
from cubeaccel.protocol.envd_process import (
    DataEvent,
    EndEvent,
    ProcessConfig,
    ProcessEvent,
    ProcessInput,
    ProcessRequest,
    ProcessSelector,
    SendInputRequest,
    StartEvent,
    StartRequest,
)
from cubeaccel.protocol.errors import CubeError
from cubeaccel.protocol.proto_json import Empty

END_STREAM = connect_envelope.FLAG_END_STREAM
MAX_MESSAGE = 16 * 1024 * 1024
CHUNK = 256 * 1024
T = TypeVar("T")


# Anything with `to_json` (the protocol/ envd messages); wire/base.Message is the pydantic base of API bodies.
class Message(Protocol):
    def to_json(self) -> dict[str, object]: ...


def envelope(message: Mapping[str, object], flags: int = 0) -> bytes:
    return connect_envelope.encode_json(message, flags)


def envelopes(chunks: Iterable[bytes]) -> Iterator[tuple[int, dict[str, object]]]:
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
    except (ValueError, RecursionError):
        raise workload_error("workload.bad_reply", "from the workload service: a message is not JSON") from None


def decode(parse: Callable[[pj.Json], T], msg: pj.Json) -> T:
    """A reply read as its message; a malformed field is the service's bad reply, not a crash here."""
    try:
        return parse(msg)
    except pj.ProtoJsonError as e:
        raise workload_error("workload.bad_reply", f"from the workload service: {e}") from None


def stream_error(end: pj.Json) -> CubeError | None:
    """The end-of-stream message's error (`{"error": {code, message}}`), None for success."""
    error = decode(lambda m: pj.get_obj(m, "error"), end)
    if not error:
        return None
    code, message = decode(lambda e: (pj.get_opt_str(e, "code"), pj.get_str(e, "message")), error)
    return workload_error("workload.refused", message, connect_code=code)


def workload_error(code: str, message: str, **details: object) -> CubeError:
    return CubeError(code, message, "workload", dict(details), 502)


@dataclass
class ExecResult:
    """`exit_code` as a shell reports it: 128 + the signal after one (9 for killed, else 15)."""

    exit_code: int
    status: str
    pid: int | None

    @classmethod
    def of(cls, end: EndEvent, pid: int | None) -> ExecResult:
        code = end.exit_code
        if code < 0 or end.status.startswith("signal"):
            code = 128 + (9 if "killed" in end.status else 15)
        return cls(code, end.status, pid)


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

    def unary(self, method: str, body: Message, reply: Callable[[pj.Json], T], user: str | None = None) -> T:
        r = self.http.post(
            f"/{method}",
            content=json.dumps(body.to_json()),
            headers=self.headers(user, **{"Content-Type": "application/json"}),
        )
        if r.status_code != 200:
            raise _reply_error(r.status_code, r.content)
        try:
            out = r.json()
        except ValueError:
            raise workload_error("workload.bad_reply", f"{method}: the reply is not JSON") from None
        return decode(reply, out if isinstance(out, dict) else {})

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
        request = StartRequest(
            ProcessConfig(cmd[0], tuple(cmd[1:]), envs or None, cwd or None), stdin=stdin is not None
        )
        extra = {"Content-Type": "application/connect+json"}
        if timeout_s:
            extra["Connect-Timeout-Ms"] = str(int(timeout_s * 1000))
        body = envelope(request.to_json())
        pid: int | None = None
        result: ExecResult | None = None
        with self.http.stream("POST", "/process.Process/Start", content=body, headers=self.headers(user, **extra)) as r:
            if r.status_code != 200:
                raise _reply_error(r.status_code, r.read())
            for flags, msg in envelopes(r.iter_raw()):
                if flags & END_STREAM:
                    if (failure := stream_error(msg)) is not None:
                        raise failure
                    break
                event = decode(ProcessEvent.from_json, msg).event
                if isinstance(event, StartEvent):
                    pid = event.pid
                    if stdin is not None:
                        self._feed_stdin(pid, stdin)
                elif isinstance(event, DataEvent):
                    if event.stream == "stdout":
                        on_stdout(event.data)
                    elif event.stream == "stderr":
                        on_stderr(event.data)
                elif isinstance(event, EndEvent):
                    result = ExecResult.of(event, pid)
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
                process = ProcessSelector(pid)
                while chunk := read():
                    request = SendInputRequest(process, ProcessInput(stdin=chunk))
                    self.unary("process.Process/SendInput", request, Empty.from_json)
                self.unary("process.Process/CloseStdin", ProcessRequest(process), Empty.from_json)
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
