"""The relay both sandbox proxies use (`transport/proxy.py`), driven as an ASGI app against an in-memory upstream:
hop-by-hop headers stay on their hop both ways, the body goes through chunk by chunk as it arrives, and the
upstream is closed however the relay ends, a caller that went away included."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
from starlette.requests import ClientDisconnect, Request
from starlette.types import Message

from cubeaccel.transport import proxy

DEADLINE_S = 10.0
CALLER_HOP_HEADERS = [
    (b"host", b"caller.example"),
    (b"connection", b"keep-alive, x-caller-secret"),
    (b"keep-alive", b"timeout=99"),
    (b"proxy-connection", b"keep-alive"),
    (b"te", b"trailers"),
    (b"trailer", b"x-checksum"),
    (b"upgrade", b"h2c"),
    (b"transfer-encoding", b"chunked"),
]


class Upstream(httpx.AsyncByteStream):
    """A streamed upstream body: each chunk is produced only once `release(i)` allows it (or at once), and
    `fail` raises an upstream error after the chunks."""

    def __init__(self, chunks: list[bytes], gated: bool = False, fail: bool = False, endless: bool = False) -> None:
        self.chunks, self.fail, self.endless = chunks, fail, endless
        self.gates = [asyncio.Event() for _ in chunks]
        if not gated:
            for g in self.gates:
                g.set()
        self.produced = 0
        self.closed = asyncio.Event()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for gate, chunk in zip(self.gates, self.chunks, strict=True):
            await gate.wait()
            self.produced += 1
            yield chunk
        if self.fail:
            raise httpx.ReadError("the sandbox's channel went away")
        while self.endless:
            await asyncio.sleep(0)
            yield b"more"
        await asyncio.Event().wait()  # an open stream: it ends only when closed

    async def aclose(self) -> None:
        self.closed.set()


async def upstream_response(body: Upstream, headers: list[tuple[str, str]] | None = None) -> httpx.Response:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers=headers or [], stream=body)

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://upstream")
    return await client.send(client.build_request("GET", "/"), stream=True)


def scope(spec: str = "2.1", headers: list[tuple[bytes, bytes]] | None = None, method: str = "GET") -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": spec},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": "/",
        "raw_path": b"/",
        "query_string": b"",
        "headers": headers or [],
        "server": ("front", 80),
        "client": ("caller", 1234),
    }


def run(coro: Awaitable[Any]) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(coro, DEADLINE_S)

    return asyncio.run(bounded())


def test_hop_by_hop_headers_stay_on_their_hop_both_ways() -> None:
    seen: list[httpx.Request] = []

    async def go() -> proxy.Relay:
        async def receive() -> Message:
            return {"type": "http.request", "body": b"", "more_body": False}

        caller = Request(scope(headers=[*CALLER_HOP_HEADERS, (b"x-app", b"kept")]), receive)
        assert proxy.request_headers(caller) == [("x-app", "kept")]

        def handler(request: httpx.Request) -> httpx.Response:
            seen.append(request)
            upstream_hop = [("Connection", "close"), ("Keep-Alive", "timeout=5"), ("Transfer-Encoding", "chunked")]
            return httpx.Response(
                200, headers=[*upstream_hop, ("Content-Length", "2"), ("X-Up", "kept")], stream=Upstream([b"ok"])
            )

        client = httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://upstream")
        upstream = await proxy.send(client, caller, "/x", proxy.request_headers(caller))
        return proxy.Relay(upstream)

    relay = run(go())
    sent = seen[0].headers
    for name in ("keep-alive", "proxy-connection", "te", "trailer", "upgrade", "transfer-encoding"):
        assert name not in sent, name
    assert sent["host"] == "upstream" and "x-caller-secret" not in sent.get("connection", "")
    assert sent["x-app"] == "kept"
    out = {k.decode(): v.decode() for k, v in relay.raw_headers}
    assert out["x-up"] == "kept" and out["content-length"] == "2"
    assert not {"connection", "keep-alive", "transfer-encoding"} & out.keys()


def test_the_body_is_relayed_chunk_by_chunk_as_it_arrives() -> None:
    chunks = [b"one", b"two", b"three"]
    body = Upstream(chunks, gated=True)
    got: list[bytes] = []

    async def go() -> None:
        relay = proxy.Relay(await upstream_response(body))
        body.gates[0].set()

        async def send(message: Message) -> None:
            if message["type"] == "http.response.body" and message["body"]:
                got.append(message["body"])
                assert body.produced == len(got)  # nothing read ahead of the caller
                if len(got) < len(chunks):
                    body.gates[len(got)].set()  # the next chunk exists only once this one was sent

        async def receive() -> Message:
            await asyncio.Event().wait()
            return {}

        task = asyncio.ensure_future(relay(scope(), receive, send))
        while len(got) < len(chunks):
            await asyncio.sleep(0.01)
        task.cancel()  # the upstream stream stays open; the caller stops waiting
        with pytest.raises(asyncio.CancelledError):
            await task
        await body.closed.wait()

    run(go())
    assert got == chunks


def test_the_upstream_is_closed_when_the_caller_goes_away_while_it_waits_for_upstream() -> None:
    body = Upstream([b"first"])  # then silence: the upstream stays open

    async def go() -> None:
        relay = proxy.Relay(await upstream_response(body))
        first = asyncio.Event()

        async def send(message: Message) -> None:
            if message.get("body"):
                first.set()

        async def receive() -> Message:
            await first.wait()
            return {"type": "http.disconnect"}

        await relay(scope(), receive, send)
        assert body.closed.is_set()

    run(go())


def test_the_upstream_is_closed_when_the_caller_goes_away_while_a_send_is_blocked() -> None:
    body = Upstream([b"first"], endless=True)

    async def go() -> None:
        relay = proxy.Relay(await upstream_response(body))
        blocked = asyncio.Event()

        async def send(message: Message) -> None:
            if message.get("body"):
                blocked.set()
                await asyncio.Event().wait()  # a caller that stopped reading

        async def receive() -> Message:
            await blocked.wait()  # the relay waits on `send`, its chunk source suspended at a chunk
            return {"type": "http.disconnect"}

        await relay(scope(), receive, send)
        assert body.closed.is_set()  # at once, not whenever the relay's generator is collected

    run(go())


def test_the_upstream_is_closed_when_sending_to_a_gone_caller_fails() -> None:
    body = Upstream([b"first"], endless=True)

    async def go() -> None:
        relay = proxy.Relay(await upstream_response(body))

        async def send(message: Message) -> None:
            if message.get("body"):
                raise OSError("the caller's connection is gone")

        async def receive() -> Message:
            await asyncio.Event().wait()
            return {}

        with pytest.raises(ClientDisconnect):
            await relay(scope(spec="2.4"), receive, send)
        assert body.closed.is_set()

    run(go())


async def _relay_failing(on_error: Callable[[httpx.HTTPError], bytes | None] | None) -> list[Message]:
    body = Upstream([b"first"], fail=True)
    relay = proxy.Relay(await upstream_response(body), on_error=on_error)
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    async def receive() -> Message:
        await asyncio.Event().wait()
        return {}

    try:
        await relay(scope(), receive, send)
    finally:
        assert body.closed.is_set()
    return sent


def test_an_upstream_error_mid_stream_cuts_the_stream_unless_the_proxy_ends_it() -> None:
    with pytest.raises(httpx.ReadError):
        run(_relay_failing(None))
    errors: list[httpx.HTTPError] = []

    def end(e: httpx.HTTPError) -> bytes:
        errors.append(e)
        return b"last"

    sent = run(_relay_failing(end))
    assert [m["body"] for m in sent[1:]] == [b"first", b"last", b""]
    assert sent[-1]["more_body"] is False and isinstance(errors[0], httpx.ReadError)


@pytest.mark.parametrize(
    ("method", "headers", "framed", "framing", "body"),
    [
        ("PUT", [(b"content-length", b"4")], True, "content-length: 4", b"data"),  # a port: as it came
        ("PUT", [(b"transfer-encoding", b"chunked")], True, "chunked", b"data"),
        ("PUT", [], True, None, b""),  # not framed: no body at all
        ("POST", [(b"content-length", b"4")], False, "chunked", b"data"),  # envd's calls: POST bodies, streamed
        ("GET", [(b"content-length", b"4")], False, None, b""),
    ],
)
def test_the_callers_body_goes_upstream_as_the_proxy_asks(
    method: str, headers: list[tuple[bytes, bytes]], framed: bool, framing: str | None, body: bytes
) -> None:
    seen: list[tuple[httpx.Headers, bytes]] = []

    async def go() -> None:
        async def receive() -> Message:
            return {"type": "http.request", "body": b"data", "more_body": False}

        async def handler(request: httpx.Request) -> httpx.Response:
            seen.append((request.headers, await request.aread()))
            return httpx.Response(204)

        client = httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://upstream")
        caller = Request(scope(headers=headers, method=method), receive)
        r = await proxy.send(client, caller, "/x", proxy.request_headers(caller), framed=framed)
        await r.aclose()

    run(go())
    sent, got = seen[0]
    assert got == body
    if framing == "chunked":
        assert sent.get("transfer-encoding") == "chunked" and "content-length" not in sent
    elif framing is not None:
        assert f"content-length: {sent.get('content-length')}" == framing and "transfer-encoding" not in sent
    else:
        assert sent.get("content-length") in (None, "0") and "transfer-encoding" not in sent
