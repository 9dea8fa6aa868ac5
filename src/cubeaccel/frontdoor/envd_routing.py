"""The front door's entry: which requests go to a sandbox's envd (through `envd.EnvdProxy`) and which to E2B's
REST routes. A request is envd's when its host or headers address a sandbox (`EnvdProxy.target`), or when it is
one of envd's file routes signed, or carrying an access token, without naming the sandbox: then the sandbox is the
running one whose token made the signature or is the token. Everything else is REST.
"""

from __future__ import annotations

from starlette.requests import HTTPConnection, Request
from starlette.types import ASGIApp, Receive, Scope, Send

from cubeaccel.frontdoor.envd import PORT_UPGRADE, EnvdProxy, envd_error
from cubeaccel.frontdoor.errors import edge_error, error
from cubeaccel.frontdoor.mapping import ENVD_PORT, Refusal
from cubeaccel.protocol.errors import CubeError
from cubeaccel.transport.http_server import MAX_HEADER_BYTES, headers_too_large
from cubeaccel.wire.e2b_api import Error


class EnvdRouting:
    """ASGI: envd traffic to `envd`, the rest to `rest`; headers over the bound refused before either sees them."""

    def __init__(self, envd: EnvdProxy, rest: ASGIApp) -> None:
        self.envd = envd
        self.rest = rest

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        envd = self.envd
        if scope["type"] == "http":
            if headers_too_large(scope):  # the other listeners' bound, on the parsed request (HTTP/2 too)
                msg = f"request line and headers over {MAX_HEADER_BYTES} bytes"
                too_large = edge_error(CubeError("api.headers_too_large", msg, "api"))
                too_large.headers["connection"] = "close"
                await too_large(scope, receive, send)
                return
            request = Request(scope, receive)
            target = envd.target(request)
            if target is None and envd.unaddressed_signed_files(request):
                try:
                    found = await envd.signed_sandbox(request)
                except Refusal as e:
                    await error(e.status, e.message, e.retry)(scope, receive, send)
                    return
                if found is None:  # no running sandbox's token made this signature: envd's own answer
                    await envd_error(401, "invalid signature")(scope, receive, send)
                    return
                target = (ENVD_PORT, found)
            elif target is None and envd.unaddressed_by_token(request):
                try:
                    by_token = await envd.token_sandbox(request)
                except Refusal as e:
                    await error(e.status, e.message, e.retry)(scope, receive, send)
                    return
                if by_token is None:  # no running sandbox has this token: envd's own answer to a wrong one
                    await envd_error(401, "missing or wrong access token")(scope, receive, send)
                    return
                target = (ENVD_PORT, by_token)
            if target is not None:
                try:
                    response = await envd.handle(request, *target)
                except Refusal as e:
                    response = error(e.status, e.message, e.retry)
                await response(scope, receive, send)
                return
        elif scope["type"] == "websocket" and envd.target(HTTPConnection(scope)) is not None:
            await refuse_websocket(scope, send)
            return
        await self.rest(scope, receive, send)


async def refuse_websocket(scope: Scope, send: Send) -> None:
    """A WebSocket to a sandbox: the guest's channel carries requests and replies, not a two-way byte stream.
    Denied with a 501 that says so where the server can send one (Hypercorn can), else closed (403)."""
    if "websocket.http.response" not in scope.get("extensions", {}):
        await send({"type": "websocket.close", "code": 1008})
        return
    message = f"cubeaccel (api): {PORT_UPGRADE}: WebSocket: only plain HTTP/1.1 requests reach a sandbox (docs/e2b.md)"
    body = Error(code=501, message=message).model_dump_json().encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "websocket.http.response.start", "status": 501, "headers": head})
    await send({"type": "websocket.http.response.body", "body": body})
