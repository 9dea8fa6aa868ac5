"""A small HTTP/1.1 server over any byte stream: the transport is whatever a `Listener` hands out.

The interface (docs/workload.md, "Listener"): a `Connection` is a buffered reader (`read(n)` returns up to n bytes
and blocks until n or EOF, `readline(limit)`), a writer (`write(b)` writes all of b or raises, `flush()`), and
`close()`. A socket gives both through `makefile`; a mux stream over virtio-serial gives them by wrapping an
`io.RawIOBase` whose `readinto` waits for received data and whose `write` waits for credit. A `Listener` has
`accept() -> Connection` (raising `ListenerClosed` when it is closed) and `close()`. Nothing here knows which.

One thread per connection, keep-alive, chunked and fixed-length request bodies, `Expect: 100-continue`, and
chunked streaming responses flushed per chunk, so a slow reader blocks the writer (backpressure) instead of
growing a buffer.
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import io
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from email.message import Message
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

MAX_LINE = 65536
MAX_CHUNK_LINE = 1024
TRANSIENT_ACCEPT_ERRORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED)
DRAIN_LIMIT = 1024 * 1024  # unread request body we still drain to keep a connection alive
REASONS = {
    100: "Continue",
    200: "OK",
    204: "No Content",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    406: "Not Acceptable",
    408: "Request Timeout",
    409: "Conflict",
    411: "Length Required",
    413: "Content Too Large",
    415: "Unsupported Media Type",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    499: "Client Closed Request",
    500: "Internal Server Error",
    501: "Not Implemented",
    503: "Service Unavailable",
    504: "Gateway Timeout",
    505: "HTTP Version Not Supported",
    507: "Insufficient Storage",
}


class Reader(Protocol):
    def read(self, n: int = -1, /) -> bytes: ...
    def readline(self, limit: int = -1, /) -> bytes: ...


class Writer(Protocol):
    def write(self, data: bytes, /) -> int | None: ...
    def flush(self) -> None: ...


@dataclass
class Connection:
    reader: Reader
    writer: Writer
    close: Callable[[], None]
    peer: str = ""


class ListenerClosed(Exception):
    pass


class Listener(Protocol):
    def accept(self) -> Connection: ...
    def close(self) -> None: ...


class HttpError(Exception):
    """A request the server cannot parse: answered (if possible) and the connection closed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def socket_connection(sock: socket.socket, peer: str) -> Connection:
    reader = sock.makefile("rb", buffering=65536)
    writer = sock.makefile("wb", buffering=65536)

    def close() -> None:
        for f in (writer, reader):
            with contextlib.suppress(OSError):
                f.close()
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()

    return Connection(reader, writer, close, peer)


class SocketListener:
    """TCP or unix-socket listener (tests, and the guest before the virtio-serial mux is wired)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._closed = False

    @classmethod
    def tcp(cls, host: str, port: int) -> SocketListener:
        sock = socket.create_server((host, port), reuse_port=False)
        return cls(sock)

    @classmethod
    def unix(cls, path: str) -> SocketListener:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # 0600: only the owner may connect
        try:
            sock.bind(path)
        finally:
            os.umask(old)
        sock.listen(128)
        return cls(sock)

    @property
    def address(self) -> str:
        name = self.sock.getsockname()
        return name if isinstance(name, str) else f"{name[0]}:{name[1]}"

    def accept(self) -> Connection:
        while True:
            try:
                sock, addr = self.sock.accept()
                break
            except OSError as exc:
                if self._closed or exc.errno not in TRANSIENT_ACCEPT_ERRORS:
                    raise ListenerClosed(str(exc)) from None
                time.sleep(0.1)  # out of fds or memory for a moment: the listener itself is fine
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return socket_connection(sock, str(addr) if addr else "unix")

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


class Body:
    """A request body: fixed length or chunked; `read(n)` returns b"" at its end."""

    def __init__(self, reader: Reader, length: int | None, chunked: bool, on_first_read: Callable[[], None]) -> None:
        self._reader = reader
        self._remaining = length or 0
        self._chunked = chunked
        self._chunk_left = 0
        self._done = not chunked and not length
        self._on_first_read: Callable[[], None] | None = on_first_read
        self.consumed = 0

    @property
    def done(self) -> bool:
        return self._done

    def read(self, n: int = 65536) -> bytes:
        if self._done:
            return b""
        if self._on_first_read is not None:
            self._on_first_read()
            self._on_first_read = None
        data = self._read_chunked(n) if self._chunked else self._read_fixed(n)
        self.consumed += len(data)
        return data

    def read_all(self, limit: int) -> bytes:
        out = bytearray()
        while True:
            data = self.read(min(65536, limit + 1 - len(out)))
            if not data:
                return bytes(out)
            out += data
            if len(out) > limit:
                raise HttpError(413, f"request body exceeds {limit} bytes")

    def read_exact(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            data = self.read(n - len(out))
            if not data:
                break
            out += data
        return bytes(out)

    def drain(self, limit: int = DRAIN_LIMIT) -> bool:
        """Read the rest (up to `limit`); False if more was left and the connection must close."""
        total = 0
        while not self._done:
            data = self.read(65536)
            total += len(data)
            if total > limit:
                return False
        return True

    def _read_fixed(self, n: int) -> bytes:
        data = self._reader.read(min(n, self._remaining))
        if not data:
            raise HttpError(400, "request body ended early")
        self._remaining -= len(data)
        self._done = self._remaining == 0
        return data

    def _read_chunked(self, n: int) -> bytes:
        if self._chunk_left == 0:
            line = self._reader.readline(MAX_CHUNK_LINE)
            if not line.endswith(b"\n"):
                raise HttpError(400, "bad chunk size line")
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise HttpError(400, "bad chunk size") from None
            if size < 0:
                raise HttpError(400, "bad chunk size")
            if size == 0:
                while True:  # trailers, ended by an empty line
                    trailer = self._reader.readline(MAX_LINE)
                    if not trailer:
                        raise HttpError(400, "body ended inside trailers")
                    if trailer in (b"\r\n", b"\n"):
                        break
                self._done = True
                return b""
            self._chunk_left = size
        data = self._reader.read(min(n, self._chunk_left))
        if not data:
            raise HttpError(400, "request body ended inside a chunk")
        self._chunk_left -= len(data)
        if self._chunk_left == 0 and self._reader.readline(3) not in (b"\r\n", b"\n"):
            raise HttpError(400, "chunk not followed by CRLF")
        return data


# An HTTP/1 request line and headers; protocol/agent_messages.Request is an agent protocol line.
@dataclass
class Request:
    method: str
    target: str
    version: str
    headers: Message
    body: Body
    path: str = ""
    query: dict[str, list[str]] = field(default_factory=dict)

    def header(self, name: str, default: str = "") -> str:
        value = self.headers.get(name)
        return default if value is None else str(value)

    def param(self, name: str) -> str | None:
        values = self.query.get(name)
        return values[0] if values else None


class Response:
    """Writes one response: `send` (whole body) or `start_chunked` + `chunk`... + `end`."""

    def __init__(self, writer: Writer, keep_alive: bool) -> None:
        self._w = writer
        self.keep_alive = keep_alive
        self.started = False
        self.finished = False
        self._chunked = False

    def _head(self, status: int, headers: list[tuple[str, str]]) -> bytes:
        lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Unknown')}"]
        lines += [f"{k}: {v}" for k, v in headers]
        if not self.keep_alive:
            lines.append("Connection: close")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def send(self, status: int, headers: list[tuple[str, str]], body: bytes = b"") -> None:
        self.started = True
        length = [] if status in (204, 304) else [("Content-Length", str(len(body)))]
        self._w.write(self._head(status, headers + length) + body)
        self._w.flush()
        self.finished = True

    def send_json(self, status: int, obj: Any, headers: list[tuple[str, str]] | None = None) -> None:
        body = json.dumps(obj, separators=(",", ":")).encode()
        self.send(status, [("Content-Type", "application/json"), *(headers or [])], body)

    def send_head(self, status: int, headers: list[tuple[str, str]]) -> None:
        """A head with no body and no framing header of ours: a HEAD reply keeps the Content-Length it is given."""
        self.started = True
        self._w.write(self._head(status, headers))
        self._w.flush()
        self.finished = True

    def start_fixed(self, status: int, headers: list[tuple[str, str]], length: int) -> None:
        """Head of a body of known length, then `write` it piece by piece."""
        self.started = True
        self._w.write(self._head(status, [*headers, ("Content-Length", str(length))]))

    def write(self, data: bytes) -> None:
        self._w.write(data)
        self._w.flush()

    def start_chunked(self, status: int, headers: list[tuple[str, str]]) -> None:
        self.started, self._chunked = True, True
        self._w.write(self._head(status, [*headers, ("Transfer-Encoding", "chunked")]))
        self._w.flush()

    def chunk(self, data: bytes) -> None:
        if data:
            self._w.write(b"%x\r\n" % len(data) + data + b"\r\n")
            self._w.flush()

    def end(self) -> None:
        if self._chunked and not self.finished:
            self._w.write(b"0\r\n\r\n")
            self._w.flush()
        self.finished = True


Handler = Callable[[Request, Response], None]


def read_request(conn: Connection) -> Request | None:
    """The next request head, or None when the peer closed between requests."""
    line = conn.reader.readline(MAX_LINE + 1)
    while line in (b"\r\n", b"\n"):  # tolerated between requests (RFC 9112 §2.2)
        line = conn.reader.readline(MAX_LINE + 1)
    if not line:
        return None
    if len(line) > MAX_LINE or not line.endswith(b"\n"):
        raise HttpError(400, "request line too long or cut short")
    parts = line.decode("latin-1").rstrip("\r\n").split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise HttpError(400 if len(parts) != 3 else 505, "malformed request line")
    method, target, version = parts
    try:
        headers = http.client.parse_headers(conn.reader)  # bounded: 100 lines of 64 KiB
    except (http.client.HTTPException, UnicodeDecodeError) as exc:
        raise HttpError(431, f"bad headers: {type(exc).__name__}") from None
    te = str(headers.get("Transfer-Encoding", "")).lower()
    chunked = "chunked" in te
    if te and not te.endswith("chunked"):
        raise HttpError(400, "unsupported transfer-encoding")
    length: int | None = None
    if not chunked and headers.get("Content-Length") is not None:
        try:
            length = int(str(headers["Content-Length"]))
        except ValueError:
            raise HttpError(400, "bad content-length") from None
        if length < 0:
            raise HttpError(400, "bad content-length")
    expect_continue = str(headers.get("Expect", "")).lower() == "100-continue"

    def on_first_read() -> None:
        if expect_continue and version == "HTTP/1.1":
            conn.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            conn.writer.flush()

    url = urlsplit(target)
    body = Body(conn.reader, length, chunked, on_first_read)
    return Request(method, target, version, headers, body, url.path, parse_qs(url.query, keep_blank_values=True))


def serve_connection(conn: Connection, handler: Handler) -> None:
    """Serve requests on one connection until it closes, a request asks to close, or a stream breaks."""
    try:
        while True:
            try:
                request = read_request(conn)
            except HttpError as err:
                _refuse(conn, err)
                return
            if request is None:
                return
            connection_hdr = request.header("Connection").lower()
            keep_alive = (
                "close" not in connection_hdr if request.version == "HTTP/1.1" else "keep-alive" in connection_hdr
            )
            response = Response(conn.writer, keep_alive)
            try:
                handler(request, response)
            except HttpError as err:
                if response.started:
                    return
                response.keep_alive = False
                response.send_json(err.status, {"code": err.status, "message": str(err)})
                return
            except (BrokenPipeError, ConnectionError):
                return
            except Exception as exc:  # a bug answers 500 and the server keeps serving others
                log(f"handler error on {request.method} {request.path}: {type(exc).__name__}: {exc}")
                if not response.started:
                    response.keep_alive = False
                    response.send_json(500, {"code": 500, "message": f"internal error: {type(exc).__name__}"})
                return
            if not response.started:  # a handler that answered nothing: never leave the client waiting
                response.keep_alive = False
                response.send_json(500, {"code": 500, "message": "no response"})
            elif not response.finished:
                response.end()
            if not response.keep_alive or not request.body.drain():
                return
    except (OSError, ValueError):  # the peer vanished mid-write, or a closed file
        return
    finally:
        conn.close()


def _refuse(conn: Connection, err: HttpError) -> None:
    with contextlib.suppress(OSError, ValueError):
        Response(conn.writer, keep_alive=False).send_json(err.status, {"code": err.status, "message": str(err)})


def log(message: str) -> None:
    print(f"cube-workload: {message}", file=sys.stderr, flush=True)


class Server:
    """Accepts connections from a listener, one daemon thread each, at most `max_connections` at once."""

    def __init__(self, listener: Listener, handler: Handler, max_connections: int = 512) -> None:
        self.listener = listener
        self.handler = handler
        self._slots = threading.BoundedSemaphore(max_connections)
        self._stopping = threading.Event()

    def serve_forever(self) -> None:
        while not self._stopping.is_set():
            try:
                conn = self.listener.accept()
            except ListenerClosed:
                return
            if not self._slots.acquire(blocking=False):
                _refuse(conn, HttpError(503, "too many connections"))
                conn.close()
                continue
            threading.Thread(target=self._run, args=(conn,), daemon=True, name=f"conn {conn.peer}").start()

    def _run(self, conn: Connection) -> None:
        try:
            serve_connection(conn, self.handler)
        finally:
            self._slots.release()

    def stop(self) -> None:
        self._stopping.set()
        self.listener.close()


def buffered_pair(raw_reader: io.RawIOBase, raw_writer: io.RawIOBase, close: Callable[[], None]) -> Connection:
    """A Connection from raw byte streams (e.g. a mux stream): buffered reads, writes passed through."""
    return Connection(io.BufferedReader(raw_reader, 65536), io.BufferedWriter(raw_writer, 65536), close)
