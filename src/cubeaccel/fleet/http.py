"""One asyncio HTTP/1.1 listener that is every simulated node's Cubelet API at once.

Node `i` is reached at its own loopback address (`node_address`): Linux routes all of 127.0.0.0/8 to `lo`, so a
listener on the wildcard address accepts connections to any of them, and the address a connection arrived on
(`getsockname`) names the node. Chosen over one port per node (10,000 listening sockets) and over a path prefix
(CubeMaster accepts only `http://HOST:PORT` as a node's URL). Peers outside 127.0.0.0/8 are closed at once: the
simulator serves this machine only.

Per node address rather than a Host header, because a dead node must look dead: its connections are closed
without a reply (a crashed Cubelet's RST), which CubeMaster sees as `cubelet.unreachable`. The parser is the
minimum CubeMaster's httpx client needs (Content-Length bodies, keep-alive); a request it cannot read closes the
connection.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

IDLE_S = 5.0  # a keep-alive connection idle this long is closed (uvicorn's default keep-alive)
MAX_HEAD = 64 * 1024
MAX_BODY = 4 * 1024 * 1024
REASONS = {200: "OK", 201: "Created", 202: "Accepted", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found"}


def node_address(i: int) -> str:
    """Node `i`'s loopback address: 127.A.B.C with C in 1..250, never 127.0.0.x (kept for real listeners)."""
    return f"127.{1 + i // 62_500}.{(i // 250) % 250}.{1 + i % 250}"


def node_index(address: str) -> int | None:
    parts = address.split(".")
    if len(parts) != 4 or parts[0] != "127":
        return None
    a, b, c = int(parts[1]), int(parts[2]), int(parts[3])
    if a < 1 or not 1 <= c <= 250 or b >= 250:
        return None
    return (a - 1) * 62_500 + b * 250 + (c - 1)


@dataclass(frozen=True)
class NodeRequest:
    node: int
    method: str
    path: str
    query: str
    headers: dict[str, str]  # lower-cased names
    body: bytes


Handler = Callable[[NodeRequest], Awaitable[tuple[int, dict[str, Any]] | None]]  # None: drop the connection


async def serve_connection(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, handler: Handler, open_: set[asyncio.StreamWriter]
) -> None:
    open_.add(writer)
    try:
        local = writer.get_extra_info("sockname")
        peer = writer.get_extra_info("peername")
        node = node_index(str(local[0])) if local else None
        if node is None or not str(peer[0]).startswith("127."):
            return
        while True:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), IDLE_S)
            except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                return
            req = _parse(node, head)
            if req is None:
                return
            length = int(req.headers.get("content-length", "0") or 0)
            if length > MAX_BODY or "transfer-encoding" in req.headers:
                return
            body = await reader.readexactly(length) if length else b""
            reply = await handler(NodeRequest(req.node, req.method, req.path, req.query, req.headers, body))
            if reply is None:
                return
            status, payload = reply
            data = json.dumps(payload, separators=(",", ":")).encode()
            writer.write(
                f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(data)}\r\n\r\n".encode()
                + data
            )
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError, ValueError):
        return
    finally:
        open_.discard(writer)
        writer.close()


def _parse(node: int, head: bytes) -> NodeRequest | None:
    try:
        lines = head.decode("latin-1").split("\r\n")
        method, target, _version = lines[0].split(" ", 2)
    except ValueError:
        return None
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            return None
        headers[name.strip().lower()] = value.strip()
    path, _, query = target.partition("?")
    return NodeRequest(node, method, path, query, headers, b"")


class NodeListener:
    """The listener on the wildcard address (every 127/8 address) and its open connections."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections: set[asyncio.StreamWriter] = set()
        self.server: asyncio.Server | None = None

    async def start(self, port: int) -> int:
        """Listening on `port` (0: a free one); returns the port."""
        self.server = await asyncio.start_server(
            lambda r, w: serve_connection(r, w, self.handler, self.connections),
            "0.0.0.0",
            port,
            limit=MAX_HEAD,
            backlog=4096,
        )
        return int(self.server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        """No new connections, and the open ones closed: each connection's task sees EOF and ends (cancelling
        them instead trips asyncio's stream callback on Python 3.11)."""
        if self.server is not None:
            self.server.close()
        for w in list(self.connections):
            w.close()
        while self.connections:
            await asyncio.sleep(0.01)
