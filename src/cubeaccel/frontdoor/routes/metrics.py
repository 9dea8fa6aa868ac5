"""E2B's metrics route: the guest's own samples (read over the envd proxy) with the sandbox's devices as its
node's Cubelet lists them (asked of CubeMaster with the front door's admin key)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from cubeaccel.frontdoor.envd import EnvdProxy
from cubeaccel.frontdoor.mapping import Refusal
from cubeaccel.frontdoor.master import FrontDoorMaster
from cubeaccel.frontdoor.metrics import devices_of, e2b_metrics, window
from cubeaccel.frontdoor.routes.common import Handler, api_key, live
from cubeaccel.transport.master_client import Calls


class Metrics:
    def __init__(self, master: FrontDoorMaster, envd: EnvdProxy) -> None:
        self.master = master
        self.envd = envd

    def handlers(self) -> dict[str, Handler]:
        """By the names `app.REST_ROUTES` gives them."""
        return {"metrics": self.metrics}

    async def metrics(self, request: Request) -> Response:
        """E2B's metrics of a running sandbox (404 otherwise): the guest's own samples, every 5 s for the last
        hour, within `start`/`end`; the newest carries the sandbox's devices (frontdoor/metrics.py)."""
        key = api_key(request)
        sid = request.path_params["sandbox_id"]
        try:
            start, end = window(request.query_params.get("start"), request.query_params.get("end"))
        except ValueError:
            raise Refusal(400, "cubeaccel (api): start and end are Unix seconds") from None
        row = await live(self.master, key, sid)
        guest = await self.envd.guest_metrics(sid)
        listed = await self.master.admin(Calls.node_devices(row.node or ""))
        devices = devices_of(row.device_ids, listed.devices, guest.devices)
        return JSONResponse(e2b_metrics(guest, start, end, devices))
