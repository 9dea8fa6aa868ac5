"""The reverse-proxy relay both sandbox proxies share (the front door's envd proxy, the Cubelet's workload proxy).

What a hop does to the message is the same at both, so it is written once: hop-by-hop headers dropped both ways
(`protocol/hop_by_hop.py`; the upstream's Content-Length kept, since the body goes through raw and whole), the
body streamed chunk by chunk as it arrives and never buffered, and the upstream response closed whatever ends
the relay: its end, an upstream error, or the caller going away. That last one is the reason for `Relay`: a
streaming response left to a generator's `finally` closes the upstream only if the generator is resumed or
collected, and a caller that disconnects while the response waits on `send` leaves it suspended.

What stays with each proxy is its policy: who may pass, where a request goes, what it adds or rewrites, how a
refusal reads, and what an upstream error mid-stream becomes (`on_error`).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Iterable
from typing import Any

import anyio
import httpx
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from cubeaccel.protocol.hop_by_hop import HOP_BY_HOP

# An upstream error mid-stream → a last chunk that ends the caller's stream cleanly, or None to cut it (the
# error propagates, and the server drops the connection).
OnError = Callable[[httpx.HTTPError], bytes | None]


def request_headers(request: Request, drop: frozenset[str] = HOP_BY_HOP) -> list[tuple[str, str]]:
    """The caller's headers for the next hop, less this hop's own (and whatever else the proxy keeps back)."""
    return [(k, v) for k, v in request.headers.items() if k.lower() not in drop]


def response_headers(upstream: httpx.Response) -> dict[str, str]:
    """The upstream's headers for the caller, less hop-by-hop ones; Content-Length stays (the raw body is
    relayed as it came, so it is still true)."""
    return {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP - {"content-length"}}


async def send(
    client: httpx.AsyncClient,
    request: Request,
    url: httpx.URL | str,
    headers: Iterable[tuple[str, str]],
    *,
    body: bytes | None = None,
    framed: bool = False,
) -> httpx.Response:
    """Open the upstream response (headers read, body not). The body is `body` when the proxy rewrote it; else
    the caller's, streamed: with `framed`, whenever it came framed (Content-Length, kept, or
    Transfer-Encoding), so that an app that cannot read a chunked body still gets a length; otherwise for a
    POST only, chunked."""
    out = list(headers)
    content: Any = body
    if body is None:
        length = request.headers.get("content-length")
        if framed and (length is not None or "transfer-encoding" in request.headers):
            content = request.stream()
            if length is not None:
                out.append(("Content-Length", length))
        elif not framed and request.method == "POST":
            content = request.stream()
    return await client.send(client.build_request(request.method, url, headers=out, content=content), stream=True)


class Relay(StreamingResponse):
    """The upstream response, streamed to the caller with its status and (filtered) headers. `observe` sees
    each chunk before the caller does; `on_error` decides what an upstream error mid-stream becomes."""

    def __init__(
        self,
        upstream: httpx.Response,
        *,
        observe: Callable[[bytes], None] | None = None,
        on_error: OnError | None = None,
    ) -> None:
        self.upstream = upstream
        self._observe = observe
        self._on_error = on_error
        self._chunks: AsyncGenerator[bytes, None] = self._relay()
        super().__init__(self._chunks, status_code=upstream.status_code, headers=response_headers(upstream))

    async def _relay(self) -> AsyncGenerator[bytes, None]:
        try:
            async for chunk in self.upstream.aiter_raw():
                if self._observe is not None:
                    self._observe(chunk)
                yield chunk
        except httpx.HTTPError as e:
            last = self._on_error(e) if self._on_error is not None else None
            if last is None:
                raise
            yield last

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):  # also when the caller went away and the task is cancelled
                await self._chunks.aclose()
                await self.upstream.aclose()
