"""Other ports of the sandbox: a plain HTTP/1.1 request forwarded to TCP 127.0.0.1:<port> inside the guest.

The guest's only path in from outside is its workload channel, so `GET /cubeaccel/port/8000/index.html` on that
channel (behind the sandbox's access token, checked by the caller: app.py) becomes `GET /index.html` to whatever
listens on port 8000 in the guest, and its reply comes back as it arrives (a fixed-length body streamed as is,
anything else re-chunked per read). One TCP connection per forwarded request. An `Upgrade` (WebSocket) cannot
be carried by a request/response channel and is refused, as is a port nothing listens on; codes are catalogued
(`port.*`, protocol/error_catalog.py).
"""

from __future__ import annotations

import contextlib
import http.client
import re
import socket

from cubeaccel.protocol.hop_by_hop import HOP_BY_HOP, SANDBOX_CHANNEL_HEADERS
from cubeaccel.workload.http1 import Request, Response

PORT_PREFIX = "/cubeaccel/port/"
CONNECT_TIMEOUT_S = 10.0
READ_SIZE = 65536
NOT_FORWARDED = HOP_BY_HOP | SANDBOX_CHANNEL_HEADERS
_PORT_TARGET = re.compile(r"/cubeaccel/port/(\d{1,5})(/[^?#]*)?(\?.*)?", re.DOTALL)

INVALID = "port.invalid"
NOT_LISTENING = "port.not_listening"
UPGRADE = "port.upgrade_unsupported"
BAD_REPLY = "port.bad_reply"


class PortError(Exception):
    """A forwarded request refused before any reply head: `code` is catalogued, `status` its HTTP status."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"cubeaccel (workload): {code}: {message}")
        self.status = status
        self.code = code


def split_target(target: str) -> tuple[int, str]:
    """(port, the app's own request target) from `/cubeaccel/port/<port>[/path][?query]`; the path defaults to
    `/`. A port outside 1-65535 or a malformed target is PortError 400."""
    m = _PORT_TARGET.fullmatch(target)
    if m is None:
        raise PortError(400, INVALID, f"{target[:80]!r} is not {PORT_PREFIX}<port>/<path>")
    port = int(m.group(1))
    if not 1 <= port <= 65535:
        raise PortError(400, INVALID, f"port {port} is not 1-65535")
    return port, (m.group(2) or "/") + (m.group(3) or "")


def request_head(method: str, target: str, port: int, headers: list[tuple[str, str]], body: str | None) -> bytes:
    """The request head the app gets: its own target, `Host: localhost:<port>` (the front door passes the
    caller's in X-Forwarded-Host), the end-to-end headers, and the body's framing (`body`: "chunked", a length,
    or None)."""
    lines = [f"{method} {target} HTTP/1.1", f"Host: localhost:{port}"]
    lines += [f"{k}: {v}" for k, v in headers]
    if body == "chunked":
        lines.append("Transfer-Encoding: chunked")
    elif body is not None:
        lines.append(f"Content-Length: {body}")
    lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def end_to_end(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The headers that travel on, less those that `Connection` names (RFC 9110 §7.6.1)."""
    named = {token.strip().lower() for k, v in headers if k.lower() == "connection" for token in v.split(",") if token}
    return [(k, v) for k, v in headers if k.lower() not in NOT_FORWARDED and k.lower() not in named]


def forward(request: Request, response: Response) -> None:
    """Forward `request` (its target under PORT_PREFIX) and stream the app's reply into `response`."""
    try:
        port, target = split_target(request.target)
        if request.header("Upgrade"):
            raise PortError(
                501, UPGRADE, f"Upgrade: {request.header('Upgrade')[:40]}: only plain HTTP/1.1 requests are forwarded"
            )
        sock = _connect(port)
    except PortError as err:
        _refuse(request, response, err)
        return
    try:
        _exchange(sock, port, target, request, response)
    finally:
        with contextlib.suppress(OSError):
            sock.close()


def _connect(port: int) -> socket.socket:
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=CONNECT_TIMEOUT_S)
    except ConnectionRefusedError:
        raise PortError(502, NOT_LISTENING, f"nothing listens on port {port} in the sandbox") from None
    except OSError as e:
        raise PortError(502, NOT_LISTENING, f"port {port} in the sandbox: {e.strerror or type(e).__name__}") from None
    sock.settimeout(None)  # the app may take as long as it likes to answer or to stream
    return sock


def _exchange(sock: socket.socket, port: int, target: str, request: Request, response: Response) -> None:
    given = [(str(k), str(v)) for k, v in request.headers.items()]
    te = request.header("Transfer-Encoding").lower()
    length = request.header("Content-Length")
    framing = "chunked" if "chunked" in te else (length if length else None)
    sock.sendall(request_head(request.method, target, port, end_to_end(given), framing))
    while True:  # the body as it arrives; the channel's credit window is the backpressure
        data = request.body.read(READ_SIZE)
        if not data:
            break
        sock.sendall(b"%x\r\n%b\r\n" % (len(data), data) if framing == "chunked" else data)
    if framing == "chunked":
        sock.sendall(b"0\r\n\r\n")
    reply = http.client.HTTPResponse(sock, method=request.method)
    try:
        reply.begin()
    except (http.client.HTTPException, OSError) as e:
        _refuse(request, response, PortError(502, BAD_REPLY, f"port {port}: no HTTP/1.x reply ({type(e).__name__})"))
        return
    headers = end_to_end(reply.getheaders())
    if reply.status == 101:
        _refuse(request, response, PortError(502, BAD_REPLY, f"port {port} switched protocols unasked"))
        return
    declared = reply.getheader("Content-Length")
    no_body = request.method == "HEAD" or reply.status in (204, 304) or 100 <= reply.status < 200
    if no_body:
        if declared is not None and declared.isdigit():
            headers.append(("Content-Length", declared))  # HEAD: what a GET would carry
        response.send_head(reply.status, headers)
        return
    if reply.chunked or reply.length is None:
        response.start_chunked(reply.status, headers)
        while data := reply.read1(READ_SIZE):
            response.chunk(data)
        response.end()
        return
    response.start_fixed(reply.status, headers, reply.length)
    sent = 0
    while data := reply.read1(READ_SIZE):
        response.write(data)
        sent += len(data)
    if not sent:
        response.write(b"")  # flushes the head of an empty body
    if sent != int(declared or 0):
        raise ConnectionError(f"port {port}: the reply ended after {sent} of {declared} bytes")


def _refuse(request: Request, response: Response, err: PortError) -> None:
    if not request.body.drain():
        response.keep_alive = False
    response.send_json(err.status, {"code": err.status, "message": str(err)})
