"""A reply sent before its request's body was read says `Connection: close`, and the unread body is discarded.

Hypercorn closes an HTTP/1.1 connection whose request body was not all read when the reply ended, without saying
so in the reply. A client that reuses the connection at once (httpx, the E2B SDK) then sends its next request into
a connection the server is closing and gets "Server disconnected without sending a response". The front door
answers many requests from their headers alone (an unknown sandbox, a missing key, a body over the limit), so each
such reply tells the client not to reuse the connection.

Hypercorn also hands the app its body through a queue of 10 messages and, when the reply ends, puts
`http.disconnect` on that same queue from inside the app's last `send`: with the queue full of body nobody reads,
that `send` never returns and the connection stays open, its client still sending (a 413 for a 64 MiB chunked
body held the connection until the client gave up). So while the last reply message goes out, the unread body is
drained and dropped until the disconnect arrives. uvicorn (CubeMaster, the Cubelet) needs none of this.
"""

from __future__ import annotations

import asyncio
import contextlib

from starlette.types import ASGIApp, Message, Receive, Scope, Send

DRAIN_S = 5.0  # at most this long after the reply; the disconnect normally comes at once


def _has_body(scope: Scope) -> bool:
    for name, value in scope.get("headers", ()):
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() not in (b"", b"0")):
            return True
    return False


async def _drain(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect" or not message.get("more_body", False):
            return


def close_when_body_unread(app: ASGIApp) -> ASGIApp:
    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _has_body(scope):
            await app(scope, receive, send)
            return
        http1 = str(scope.get("http_version", "1.1")).startswith("1")
        read_all = False

        async def counting_receive() -> Message:
            nonlocal read_all
            message = await receive()
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                read_all = True
            return message

        async def closing_send(message: Message) -> None:
            if message["type"] == "http.response.start" and not read_all and http1:
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            if message["type"] != "http.response.body" or message.get("more_body", False) or read_all:
                await send(message)
                return
            drain = asyncio.create_task(_drain(receive))
            try:
                await send(message)
            finally:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(drain, DRAIN_S)

        await app(scope, counting_receive, closing_send)

    return wrapped
