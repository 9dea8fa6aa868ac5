"""E2B's sandbox routes: create (answered once the guest is validated), connect, get, list, kill, timeout and
network. Each call to CubeMaster carries the caller's own key, so CubeMaster scopes it to the caller's tenant."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from cubeaccel.frontdoor import mapping as M
from cubeaccel.frontdoor.config import FrontDoorConfig
from cubeaccel.frontdoor.mapping import Refusal
from cubeaccel.frontdoor.master import FrontDoorMaster
from cubeaccel.frontdoor.routes.common import Handler, api_key, body_of, live, sandbox
from cubeaccel.model.sandbox_states import ENDED_STATES, SandboxState
from cubeaccel.transport.master_client import Calls
from cubeaccel.wire.e2b_api import ConnectBody, NetworkUpdate, NewSandbox, TimeoutBody
from cubeaccel.wire.master_api import SandboxReply

GONE = (SandboxState.DELETING, SandboxState.DELETED)  # E2B's kill answers 404 for these


class Sandboxes:
    """The sandbox routes over one CubeMaster client and the front door's settings (its secret derives each
    sandbox's envd token, so a replica sharing the secret answers the same)."""

    def __init__(self, master: FrontDoorMaster, cfg: FrontDoorConfig) -> None:
        self.master = master
        self.cfg = cfg

    def handlers(self) -> dict[str, Handler]:
        """By the names `app.REST_ROUTES` gives them."""
        return {
            "create": self.create,
            "list": self.list_sandboxes,
            "get_info": self.get_info,
            "kill": self.kill,
            "set_timeout": self.set_timeout,
            "update_network": self.update_network,
            "connect": self.connect,
        }

    def token(self, sandbox_id: str) -> str:
        return M.envd_token(self.cfg.secret, sandbox_id)

    async def create(self, request: Request) -> Response:
        cfg, master = self.cfg, self.master
        key = api_key(request)
        req: NewSandbox = await body_of(request, NewSandbox)
        sid = f"{await master.id_prefix(key)}{uuid.uuid4().hex[:16]}"  # in the tenant's own id namespace
        body = M.create_body(req, sid, self.token(sid))
        asked_s = body.timeout_s or float(M.DEFAULT_TIMEOUT_S)  # create_body always sets it
        lease_s = min(asked_s, cfg.create_lease_s)
        body = body.model_copy(update={"timeout_s": lease_s})  # the client's lifetime: once its reply is ready
        t0 = time.monotonic()
        row = await master.call(Calls.create(body, request.headers.get("idempotency-key")), key)
        sid = row.id  # an idempotent repeat answers the first create's sandbox (its token: derived too)
        row = await self.wait_running(key, sid, row, lease_s)
        if asked_s > lease_s:
            row = await self.set_lifetime(key, sid, max(1.0, asked_s - (time.monotonic() - t0)))  # from the create
        return JSONResponse(
            M.created(row, self.token(sid), cfg.domain, M.traffic_token(cfg.secret, sid)).body(), status_code=201
        )

    async def set_lifetime(self, key: str, sid: str, timeout_s: float) -> SandboxReply:
        """The lifetime the client asked for; refused (a tenant's cap), the sandbox is deleted: nobody has it."""
        try:
            return await self.master.call(Calls.set_timeout(sid, timeout_s), key)
        except Refusal:
            with contextlib.suppress(Refusal):
                await self.master.call(Calls.delete(sid), key)
            raise

    async def wait_running(self, key: str, sid: str, row: SandboxReply, lease_s: float) -> SandboxReply:
        """Until the guest is validated: E2B's create returns a sandbox ready for commands. The create's lease
        is renewed every third of it meanwhile (a start may take longer than the lease)."""
        cfg, master = self.cfg, self.master
        deadline = time.monotonic() + cfg.create_wait_s
        renewed = time.monotonic()
        pause = 0.05
        while row.state != M.LIVE:
            if time.monotonic() - renewed > lease_s / 3:
                renewed = time.monotonic()
                with contextlib.suppress(Refusal):  # not live any more: the next read says how it ended
                    await master.call(Calls.set_timeout(sid, lease_s), key)
            if row.state in ENDED_STATES:
                if row.error is not None and row.error.code:
                    raise M.refusal_from_error(row.error.model_dump(), 500)
                raise Refusal(500, f"cubeaccel (api): sandbox {sid} ended while starting ({row.state})")
            if time.monotonic() > deadline:
                with contextlib.suppress(Refusal):
                    await master.call(Calls.delete(sid), key)
                raise Refusal(
                    504, f"cubeaccel (api): sandbox {sid} was not running after {cfg.create_wait_s:g}s; deleted"
                )
            t0 = time.monotonic()
            row = await sandbox(master, key, sid, wait_s=max(0.1, min(20.0, lease_s / 3, deadline - t0)))
            if time.monotonic() - t0 < pause:  # answered at once: a CubeMaster without `?wait=`, poll gently
                await asyncio.sleep(pause)
                pause = min(pause * 1.5, 0.25)
        return row

    async def connect(self, request: Request) -> Response:
        cfg, master = self.cfg, self.master
        key = api_key(request)
        sid = request.path_params["sandbox_id"]
        req: ConnectBody = await body_of(request, ConnectBody, required=False)
        row = await live(master, key, sid)
        if req.timeout is not None and time.time() + req.timeout > (row.expires_at or 0.0):
            row = await master.call(Calls.set_timeout(sid, float(req.timeout)), key)
        return JSONResponse(
            M.created(row, self.token(sid), cfg.domain, M.traffic_token(cfg.secret, sid)).body(), status_code=200
        )

    async def get_info(self, request: Request) -> Response:
        key = api_key(request)
        sid = request.path_params["sandbox_id"]
        row = await live(self.master, key, sid)
        return JSONResponse(M.detail(row, self.token(sid), self.cfg.domain).body())

    async def list_sandboxes(self, request: Request) -> Response:
        key = api_key(request)
        q = request.query_params
        meta = M.parse_metadata_query(q.get("metadata"))
        states = M.parse_states(q.get("state"))
        try:
            limit = int(q.get("limit") or 100)
        except ValueError as e:
            raise Refusal(400, "cubeaccel (api): limit must be an integer") from e
        newest_first = M.parse_order(q.get("order"))
        after = M.parse_started_after(q.get("startedAfter"))
        reply = await self.master.call(Calls.sandboxes(M.LIVE), key)
        rows = M.select(reply.sandboxes, meta, states, after, newest_first)
        if q.get("template"):
            rows = [r for r in rows if M.template_name(r) == q["template"]]
        chunk, nxt = M.page(rows, limit, q.get("nextToken"), newest_first)
        headers = {"x-next-token": nxt} if nxt else {}
        return JSONResponse([M.listed(r).body() for r in chunk], headers=headers)

    async def kill(self, request: Request) -> Response:
        key = api_key(request)
        sid = request.path_params["sandbox_id"]
        row = await sandbox(self.master, key, sid)
        if row.state in GONE:
            raise Refusal(404, f"sandbox {sid} not found (it is {row.state})")
        await self.master.call(Calls.delete(sid), key)
        return Response(status_code=204)

    async def set_timeout(self, request: Request) -> Response:
        key = api_key(request)
        sid = request.path_params["sandbox_id"]
        req: TimeoutBody = await body_of(request, TimeoutBody)
        await live(self.master, key, sid)
        await self.master.call(Calls.set_timeout(sid, max(1.0, req.timeout)), key)
        return Response(status_code=204)

    async def update_network(self, request: Request) -> Response:
        """E2B's `update_network`: the running sandbox's egress policy replaced whole, in place (CubeMaster records
        and audits it; the node loads it: docs/e2b.md)."""
        key = api_key(request)
        sid = request.path_params["sandbox_id"]
        req: NetworkUpdate = await body_of(request, NetworkUpdate, required=False)
        narrowing = M.network_update(req)
        await live(self.master, key, sid)
        await self.master.call(Calls.set_network(sid, narrowing), key)
        return Response(status_code=204)
