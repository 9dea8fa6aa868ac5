"""What every cubeaccel HTTP API does at its edge: one error format, stable codes, a body size limit, the docs.

Cubelet and CubeMaster both install these, so a client sees the same `{"error": {code, layer, message,
details}}` for a malformed body, an unknown field or an oversized request whichever component it calls.
The served OpenAPI documents that error body (`ErrorReply`) for every route; there is no docs UI (FastAPI's
Swagger UI and ReDoc pages load scripts from a CDN), only `/openapi.json` (docs/decisions.md).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.responses import Response

from cubeaccel.protocol.error_catalog import http_status
from cubeaccel.protocol.errors import CubeError
from cubeaccel.transport.http_server import MAX_HEADER_BYTES, HttpLimits, headers_too_large
from cubeaccel.transport.telemetry import ApiTelemetry
from cubeaccel.wire import json_guard
from cubeaccel.wire.base import UNSUPPORTED_VERSION, Strict, carried_cube_error

MAX_BODY = 1 << 20


class ErrorDetail(Strict):
    code: str  # stable, e.g. api.unknown_field, reserve.no_capacity
    layer: str  # where it failed: api, template, host_hardware, guest_kernel, ...
    message: str
    details: dict[str, Any]


class ErrorReply(Strict):
    """The body of every error reply, whatever the status (`CubeError.to_json()`)."""

    error: ErrorDetail


def _err(description: str) -> dict[str, Any]:
    return {"model": ErrorReply, "description": description}


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    404: _err("no such resource (`api.not_found`, `*.not_found`)"),
    409: _err("refused in the current state (a conflict)"),
    413: _err("request body too large (`api.body_too_large`)"),
    422: _err("request rejected: malformed JSON, unknown field, bad value, unsupported version"),
    "default": _err("any other error, in the same format"),
}


def api_app(
    title: str, body_models: tuple[type[BaseModel], ...] = (), telemetry: ApiTelemetry | None = None
) -> FastAPI:
    """A FastAPI app with our edges, the error schema on every route and no CDN-loaded docs UI.

    `body_models` are the models of bodies a route reads as a plain dict (to keep its own error code);
    their schemas are added to the OpenAPI components so `json_body(name)` can refer to them.
    `telemetry`: where requests are counted and logged (with their request id); None: nowhere.
    """
    app = FastAPI(title=title, version="1", docs_url=None, redoc_url=None, responses=ERROR_RESPONSES)
    install_api_edges(app, telemetry=telemetry)
    base_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = base_openapi()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in body_models:
                js = model.model_json_schema(ref_template="#/components/schemas/{model}")
                for name, sub in js.pop("$defs", {}).items():
                    components.setdefault(name, sub)
                components.setdefault(model.__name__, js)
            for item in schema.get("paths", {}).values():  # a json_body() ref replaces FastAPI's bare-dict schema
                for op in item.values():
                    for media in op.get("requestBody", {}).get("content", {}).values():
                        if "$ref" in media.get("schema", {}):
                            media["schema"] = {"$ref": media["schema"]["$ref"]}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def json_body(model: str) -> dict[str, Any]:
    """`openapi_extra` for a route that reads its body as a dict: document it as `model`."""
    schema = {"$ref": f"#/components/schemas/{model}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def error_response(e: CubeError) -> JSONResponse:
    return JSONResponse(status_code=http_status(e.code, e.status), content=e.to_json())


def validation_error(e: RequestValidationError) -> CubeError:
    errs = e.errors()
    if (own := carried_cube_error(errs)) is not None:  # a field's own parser refused it: its code, as before
        return own
    code = "api.malformed_json" if any(x.get("type") == "json_invalid" for x in errs) else "api.invalid_request"
    if any(x.get("type") == "extra_forbidden" for x in errs):
        code = "api.unknown_field"
    if any(x.get("type") == UNSUPPORTED_VERSION for x in errs):
        code = "api.unsupported_version"
    details = {"errors": [{"loc": list(x.get("loc", ())), "msg": x.get("msg"), "type": x.get("type")} for x in errs]}
    msg = "request rejected: " + "; ".join(f"{'.'.join(map(str, x.get('loc', ())))}: {x.get('msg')}" for x in errs[:3])
    return CubeError(code, msg, "api", details, 422)


def install_api_edges(app: FastAPI, max_body: int = MAX_BODY, telemetry: ApiTelemetry | None = None) -> None:
    @app.exception_handler(CubeError)
    async def _cube_error(request: Request, e: CubeError) -> JSONResponse:
        request.state.error_code = e.code  # for the audit log
        return error_response(e)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException) -> JSONResponse:
        code = {404: "api.not_found", 405: "api.method_not_allowed"}.get(e.status_code, "api.http_error")
        request.state.error_code = code
        return error_response(CubeError(code, str(e.detail), "api", {}, e.status_code))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
        err = validation_error(e)
        request.state.error_code = err.code
        if carried_cube_error(e.errors()) is not None:  # a field's parser refused it: what the route would have read
            request.state.refused_body = e.body
        return error_response(err)

    app.add_middleware(
        EdgeGuard, max_body=max_body, body_timeout_s=HttpLimits.from_env().body_timeout_s, telemetry=telemetry
    )


def is_workload_stream(path: str) -> bool:
    """The Cubelet's workload proxy streams bodies of any size to the guest."""
    return path.startswith("/v1/sandboxes/") and "/workload/" in path


class EdgeGuard:
    """Pure ASGI middleware in front of every route of every listener (CubeMaster, the Cubelet, the front
    door's REST routes): the body is read here, counted by the bytes that actually arrive (a chunked body has
    no Content-Length to trust), within a deadline, and parsed as strict JSON before a route sees it. A
    refusal answers in the listener's error format and closes the connection, so the rest of an oversized
    body is never read."""

    def __init__(
        self,
        app: Any,
        max_body: int = MAX_BODY,
        body_timeout_s: float = 30.0,
        telemetry: ApiTelemetry | None = None,
        render: Callable[[CubeError], Response] = error_response,
        streams: Callable[[str], bool] = is_workload_stream,
    ) -> None:
        self.app = app
        self.max_body = max_body
        self.body_timeout_s = body_timeout_s
        self.telemetry = telemetry
        self.render = render  # the front door answers in E2B's error format
        self.streams = streams  # paths whose bodies stream through unread (flow-controlled, never held whole)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
        elif self.telemetry is not None:  # the request id, the count and the log line cover refusals here too
            await self.telemetry(self._guarded, scope, receive, send)
        else:
            await self._guarded(scope, receive, send)

    async def _guarded(self, scope: Any, receive: Any, send: Any) -> None:
        if headers_too_large(scope):
            msg = f"request line and headers over {MAX_HEADER_BYTES} bytes"
            await self._refuse(scope, send, CubeError("api.headers_too_large", msg, "api"))
            return
        if self.streams(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        size = dict(scope.get("headers", ())).get(b"content-length")
        if size is not None and (not size.isdigit() or int(size) > self.max_body):
            await self._refuse(scope, send, self._too_large())
            return
        chunks: list[bytes] = []
        total = 0
        deadline = time.monotonic() + self.body_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                msg = f"request body not received within {self.body_timeout_s:g} s"
                await self._refuse(scope, send, CubeError("api.body_timeout", msg, "api"))
                return
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_body:
                await self._refuse(scope, send, self._too_large())
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if body:
            try:
                json_guard.loads(body)
            except json_guard.JsonRefused as e:
                await self._refuse(
                    scope, send, CubeError(e.code, f"request rejected: {e}", "api", {}, 422), close=False
                )
                return
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _too_large(self) -> CubeError:
        return CubeError("api.body_too_large", f"request body over {self.max_body} bytes", "api")

    async def _refuse(self, scope: Any, send: Any, e: CubeError, close: bool = True) -> None:
        scope.setdefault("state", {})["error_code"] = e.code
        response = self.render(e)
        if close:
            response.headers["connection"] = "close"
        await response(scope, _nothing, send)


async def _nothing() -> Any:
    return {"type": "http.disconnect"}


# ---- pure ASGI middleware for the routes' own edges ---------------------------------------------------------------
# Starlette's `@app.middleware("http")` (BaseHTTPMiddleware) runs the rest of the app in a task and carries the
# reply through memory streams: ~0.3 ms of CPU per request here. These two shapes cover what the servers need.
Gate = Callable[[Request], Awaitable[Response | None]]
Hook = Callable[[Request, int], Awaitable[None]]


class GateMiddleware:
    """`gate(request)` decides before the app runs: a Response is the answer (the app never sees the request),
    None lets it through. HTTP only; lifespan and websocket scopes pass untouched."""

    def __init__(self, app: Any, gate: Gate) -> None:
        self.app = app
        self.gate = gate

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and (refusal := await self.gate(Request(scope))) is not None:
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)


class BeforeReplyMiddleware:
    """`hook(request, status)` runs when the app starts its reply, before the status line goes out: what it
    writes (an audit row) is done before the caller can see the answer, as with `await call_next()` before."""

    def __init__(self, app: Any, hook: Hook) -> None:
        self.app = app
        self.hook = hook

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def hooked(message: Any) -> None:
            if message["type"] == "http.response.start":
                await self.hook(Request(scope), int(message["status"]))
            await send(message)

        await self.app(scope, receive, hooked)
