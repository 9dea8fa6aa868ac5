"""The routes that need no collaborator: liveness, and the E2B verbs a GPU sandbox refuses by design."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from cubeaccel.frontdoor.mapping import Refusal
from cubeaccel.frontdoor.routes.common import Handler, api_key

# The design excludes these for a sandbox holding a device (ARCHITECTURE.md: no snapshot of VFIO state).
REFUSED = {
    "pause": "pause",
    "resume": "resume",
    "snapshots": "snapshots",
    "fork": "fork (clone)",
    "refreshes": "refreshes",
}


async def refused(request: Request) -> Response:
    api_key(request)
    what = REFUSED.get(request.path_params.get("op", ""), request.url.path)
    raise Refusal(
        400,
        f"cubeaccel (api): {what} is not supported: a GPU sandbox's device state cannot be saved, so sandboxes "
        "are never paused, snapshotted or cloned (docs/e2b.md)",
    )


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


HANDLERS: dict[str, Handler] = {"health": health, "refused": refused}
