"""A reply sent before its request's body was read says `Connection: close`.

Hypercorn closes an HTTP/1.1 connection whose request body was not all read when the reply ended, without saying
so in the reply. A client that reuses the connection at once (httpx, the E2B SDK) then sends its next request into
a connection the server is closing and gets "Server disconnected without sending a response". The front door
answers many requests from their headers alone (an unknown sandbox, a missing key), so each such reply tells the
client not to reuse the connection. uvicorn (CubeMaster, the Cubelet) drains the body instead and needs none of
this.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send


def _has_body(scope: Scope) -> bool:
    for name, value in scope.get("headers", ()):
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() not in (b"", b"0")):
            return True
    return False


def close_when_body_unread(app: ASGIApp) -> ASGIApp:
    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        http1 = scope["type"] == "http" and str(scope.get("http_version", "1.1")).startswith("1")
        if not http1 or not _has_body(scope):
            await app(scope, receive, send)
            return
        read_all = False

        async def counting_receive() -> Message:
            nonlocal read_all
            message = await receive()
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                read_all = True
            return message

        async def closing_send(message: Message) -> None:
            if message["type"] == "http.response.start" and not read_all:
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        await app(scope, counting_receive, closing_send)

    return wrapped
