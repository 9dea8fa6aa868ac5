"""What every cubeaccel HTTP API does at its edge: one error format, stable codes, a body size limit.

Cubelet and CubeMaster both install these, so a client sees the same `{"error": {code, layer, message,
details}}` for a malformed body, an unknown field or an oversized request whichever component it calls.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from cubeaccel.model.errors import CubeError

MAX_BODY = 1 << 20


def error_response(e: CubeError) -> JSONResponse:
    return JSONResponse(status_code=e.status, content=e.to_json())


def validation_error(e: RequestValidationError) -> CubeError:
    errs = e.errors()
    code = "api.malformed_json" if any(x.get("type") == "json_invalid" for x in errs) else "api.invalid_request"
    if any(x.get("type") == "extra_forbidden" for x in errs):
        code = "api.unknown_field"
    details = {"errors": [{"loc": list(x.get("loc", ())), "msg": x.get("msg"), "type": x.get("type")} for x in errs]}
    msg = "request rejected: " + "; ".join(f"{'.'.join(map(str, x.get('loc', ())))}: {x.get('msg')}" for x in errs[:3])
    return CubeError(code, msg, "api", details, 422)


def install_api_edges(app: FastAPI, max_body: int = MAX_BODY) -> None:
    @app.exception_handler(CubeError)
    async def _cube_error(_: Request, e: CubeError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, e: HTTPException) -> JSONResponse:
        code = {404: "api.not_found", 405: "api.method_not_allowed"}.get(e.status_code, "api.http_error")
        return error_response(CubeError(code, str(e.detail), "api", {}, e.status_code))

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(e))

    @app.middleware("http")
    async def _limit(request: Request, call_next: Any) -> Any:
        size = request.headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > max_body):
            return error_response(
                CubeError("api.body_too_large", f"request body over {max_body} bytes", "api", {}, 413)
            )
        return await call_next(request)
