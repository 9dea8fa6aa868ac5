"""E2B's error body, and the REST app's exception handlers that answer in it (Starlette's defaults are
`text/plain`, which the SDK cannot read). Every error the front door sends goes through `error`."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from cubeaccel.frontdoor import mapping as M
from cubeaccel.frontdoor.mapping import Refusal
from cubeaccel.protocol.error_catalog import http_status
from cubeaccel.protocol.errors import CubeError
from cubeaccel.wire.e2b_api import Error


def error(status: int, message: str, retry: bool = False) -> JSONResponse:
    """E2B's error body; `Should-Retry: false` so the SDK does not repeat a create that was refused, `true`
    where repeating it can help (the SDK then retries even a 409)."""
    headers = {"Should-Retry": "true" if retry else "false"}
    return JSONResponse(Error(code=status, message=message).body(), status_code=status, headers=headers)


def edge_error(e: CubeError) -> Response:
    """A refusal at the server edge (transport/api_edges.EdgeGuard, shared with CubeMaster and the Cubelet) in E2B's
    format: the catalogued code leads the message, as it does for CubeMaster's refusals."""
    refusal = M.refusal_from_error(e.to_json()["error"], http_status(e.code, e.status))
    return error(refusal.status, refusal.message, refusal.retry)


async def refusal(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, Refusal)
    return error(exc.status, exc.message, exc.retry)


async def no_route(request: Request, exc: Exception) -> Response:
    status = int(getattr(exc, "status_code", 404))
    return error(status, f"cubeaccel (api): {request.method} {request.url.path}: no such E2B route here")


async def internal(request: Request, exc: Exception) -> Response:
    """A bug, in E2B's format (Starlette's default is `text/plain`, which the SDK cannot read); the exception
    itself goes to the log, never to the caller."""
    return error(500, "cubeaccel (api): api.internal_error: the front door failed on this request (logged)")


ON_ERROR = {Refusal: refusal, 404: no_route, 405: no_route, Exception: internal}
