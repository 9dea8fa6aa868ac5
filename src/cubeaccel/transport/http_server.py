"""How every cubeaccel listener is served: uvicorn with bounded headers, idle connections and bodies.

uvicorn closes an idle keep-alive connection, but not a connection whose request headers never finish
(2,000 half-sent requests stayed open), and it answers a malformed request with plain text. `GuardedH11`
adds a header deadline — a connection that has not sent complete request headers within it is closed —
and answers protocol errors in the API's JSON error format. The body deadline and the body size limit are
the API edge's (`api_edges.EdgeGuard`), counted on the bytes actually read, chunked bodies included.

The bounds can be tightened for tests through the environment (`CUBEACCEL_HTTP_HEADER_TIMEOUT_S`,
`CUBEACCEL_HTTP_BODY_TIMEOUT_S`, `CUBEACCEL_HTTP_IDLE_TIMEOUT_S`); docs/api.md lists the defaults.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn import Config
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_HEADER_BYTES = 16 * 1024  # request line + headers; a larger one is a protocol error
PEER_KEY = "cubeaccel_peer"  # ASGI scope key: (pid, uid, gid) of a unix-socket caller, from SO_PEERCRED
UNKNOWN_PEER = (-1, -1, -1)  # credentials that could not be read: matches no allowed uid


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """The connecting process's (pid, uid, gid) as the kernel recorded them at connect()."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return UNKNOWN_PEER
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


@dataclass(frozen=True)
class HttpLimits:
    header_timeout_s: float = 10.0  # from connect (or the end of the last response) to complete headers
    body_timeout_s: float = 30.0  # from the headers to the last body byte
    # A keep-alive connection with no new request. Longer than clients' own expiry (httpx: 5 s), so a client
    # never reuses a connection in the moment the server closes it (the request would meet a reset).
    idle_timeout_s: int = 15

    @classmethod
    def from_env(cls) -> HttpLimits:
        d = cls()
        return cls(
            float(os.environ.get("CUBEACCEL_HTTP_HEADER_TIMEOUT_S", d.header_timeout_s)),
            float(os.environ.get("CUBEACCEL_HTTP_BODY_TIMEOUT_S", d.body_timeout_s)),
            int(os.environ.get("CUBEACCEL_HTTP_IDLE_TIMEOUT_S", d.idle_timeout_s)),
        )


def header_bytes(scope: Any) -> int:
    """The size of a request's line and headers as parsed (method, target, `name: value\r\n` each): the bound
    is checked here too, since h11 limits only what it buffers and accepts a larger request read in one piece."""
    target = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + 1
    return len(scope.get("method", "")) + target + 11 + sum(len(k) + len(v) + 4 for k, v in scope.get("headers", ()))


def headers_too_large(scope: Any) -> bool:
    return header_bytes(scope) > MAX_HEADER_BYTES


def _error_bytes(code: str, message: str) -> bytes:
    return json.dumps({"error": {"code": code, "layer": "api", "message": message, "details": {}}}).encode()


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline on request headers and JSON protocol errors."""

    header_timeout_s = HttpLimits().header_timeout_s

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family == socket.AF_UNIX:  # who is calling, for the app to judge
            peer, inner = peer_credentials(sock), self.app

            async def with_peer(scope: Any, receive: Any, send: Any) -> None:
                scope[PEER_KEY] = peer
                await inner(scope, receive, send)

            self.app = with_peer

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:  # bytes of a new request: its headers now have a deadline
            self._arm()
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm()

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to any h11 protocol error. One of them is headers past the bound while still incomplete
        (h11 hints 431, uvicorn drops the hint): what h11 still buffers tells it apart, and it gets the 431 a
        complete request of that size gets (`api.headers_too_large`)."""
        status, reason, code = 400, b"Bad Request", "api.bad_http_request"
        if self.conn.their_state is h11.ERROR and len(self.conn.trailing_data[0]) > MAX_HEADER_BYTES:
            status, reason, code = 431, b"Request Header Fields Too Large", "api.headers_too_large"
            msg = f"request line and headers over {MAX_HEADER_BYTES} bytes"
        body = _error_bytes(code, msg)
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        try:
            self.transport.write(self.conn.send(h11.Response(status_code=status, headers=headers, reason=reason)))
            self.transport.write(self.conn.send(h11.Data(data=body)))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
        except h11.LocalProtocolError:  # h11 cannot frame a reply in this state: just close
            pass
        self.transport.close()


def run_servers(main: Coroutine[Any, Any, None], config: Config) -> None:
    """Run `main` (the servers' `serve()`s) on the event loop `config` asks for — uvloop when installed, as
    `uvicorn.run` would; a bare `asyncio.run` always gets the stdlib loop."""
    with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
        runner.run(main)


def server_config(app: Any, limits: HttpLimits | None = None, **where: Any) -> Config:
    """A uvicorn Config for one listener (`host`/`port` or `uds`) with cubeaccel's bounds."""
    limits = limits or HttpLimits.from_env()
    protocol = type("GuardedH11Bound", (GuardedH11,), {"header_timeout_s": limits.header_timeout_s})
    return Config(
        app,
        http=protocol,
        timeout_keep_alive=limits.idle_timeout_s,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        log_level="warning",
        access_log=False,
        **where,
    )
