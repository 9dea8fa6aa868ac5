"""What the REST routes share: the caller's API key, the body as a wire model, and the caller's sandbox as
CubeMaster answers it (every answer comes from CubeMaster: the front door keeps no state)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from cubeaccel.frontdoor import mapping as M
from cubeaccel.frontdoor.mapping import Refusal
from cubeaccel.frontdoor.master import FrontDoorMaster
from cubeaccel.transport.master_client import Calls
from cubeaccel.wire import json_guard
from cubeaccel.wire.master_api import SandboxReply


def api_key(request: Request) -> str:
    key = request.headers.get("x-api-key")
    if not key:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        key = token.strip() if scheme.lower() == "bearer" else ""
    if not key:
        raise Refusal(401, "cubeaccel (api): missing API key (X-API-Key: a CubeMaster tenant key)")
    return key


async def body_of(request: Request, model: type[BaseModel], required: bool = True) -> Any:
    """The REST body as `model`. The edge guard has read it already (size counted on the bytes read, within
    the body deadline) and checked it is strict JSON."""
    raw = await request.body()
    if not raw and not required:
        return model()
    try:
        return model.model_validate(json_guard.loads(raw or b"null"))
    except json_guard.JsonRefused as e:
        raise Refusal(400, f"cubeaccel (api): {e.code}: {e}") from e
    except ValidationError as e:
        msg = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors()[:3])
        raise Refusal(400, f"cubeaccel (api): api.invalid_request: invalid request body: {msg}") from e


async def sandbox(master: FrontDoorMaster, key: str, sandbox_id: str, wait_s: float = 0.0) -> SandboxReply:
    """`wait_s`: CubeMaster holds the reply until the sandbox settles (running, failed, gone), where it has
    `?wait=`; where it has not, the parameter is ignored and the caller polls."""
    return await master.call(Calls.sandbox(sandbox_id, round(wait_s, 1) if wait_s > 0 else None), key)


async def live(master: FrontDoorMaster, key: str, sandbox_id: str) -> SandboxReply:
    """The caller's running sandbox, else 404 (gone, failed, or another tenant's: CubeMaster says 404)."""
    row = await sandbox(master, key, sandbox_id)
    if row.state != M.LIVE:
        raise Refusal(404, f"sandbox {sandbox_id} not found (it is {row.state})")
    return row


Handler = Callable[[Request], Awaitable[Response]]
