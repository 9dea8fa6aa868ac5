"""The E2B-compatible front door (`cubeaccel api serve`): E2B's REST surface over CubeMaster, and envd traffic
routed to the sandbox's node (docs/e2b.md).

Stateless: every answer comes from CubeMaster or is derived (the envd token from the sandbox id and the
front door's secret), so several replicas sharing the secret and the admin key may serve side by side.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from cubeaccel.frontdoor import mapping as M
from cubeaccel.frontdoor.envd import PORT_UPGRADE, EnvdProxy, envd_error
from cubeaccel.frontdoor.mapping import ENVD_PORT, Refusal
from cubeaccel.frontdoor.master import FrontDoorMaster
from cubeaccel.frontdoor.metrics import devices_of, e2b_metrics, window
from cubeaccel.frontdoor.unread_body import close_when_body_unread
from cubeaccel.model.sandbox_states import ENDED_STATES, SandboxState
from cubeaccel.protocol.error_catalog import http_status
from cubeaccel.protocol.errors import CubeError
from cubeaccel.transport.api_edges import EdgeGuard
from cubeaccel.transport.http_server import MAX_HEADER_BYTES, HttpLimits, headers_too_large
from cubeaccel.transport.master_client import Calls
from cubeaccel.wire import json_guard
from cubeaccel.wire.e2b_api import ConnectBody, Error, NetworkUpdate, NewSandbox, TimeoutBody
from cubeaccel.wire.master_api import SandboxReply

GONE = (SandboxState.DELETING, SandboxState.DELETED)  # E2B's kill answers 404 for these
# The design excludes these for a sandbox holding a device (ARCHITECTURE.md: no snapshot of VFIO state).
REFUSED = {
    "pause": "pause",
    "resume": "resume",
    "snapshots": "snapshots",
    "fork": "fork (clone)",
    "refreshes": "refreshes",
}


# E2B's REST routes: (method, path, handler); frontdoor/openapi.py documents each (docs/openapi/frontdoor-e2b.json).
REST_ROUTES = [
    ("GET", "/health", "health"),
    ("POST", "/v2/sandboxes", "create"),
    ("POST", "/sandboxes", "create"),
    ("GET", "/v2/sandboxes", "list"),
    ("GET", "/sandboxes", "list"),
    ("GET", "/sandboxes/{sandbox_id}", "get_info"),
    ("DELETE", "/sandboxes/{sandbox_id}", "kill"),
    ("POST", "/sandboxes/{sandbox_id}/timeout", "set_timeout"),
    ("PUT", "/sandboxes/{sandbox_id}/network", "update_network"),
    ("GET", "/sandboxes/{sandbox_id}/metrics", "metrics"),
    ("POST", "/v2/sandboxes/{sandbox_id}/connect", "connect"),
    ("POST", "/sandboxes/{sandbox_id}/connect", "connect"),
    ("POST", "/sandboxes/{sandbox_id}/{op}", "refused"),
    ("GET", "/snapshots", "refused"),
    ("POST", "/snapshots", "refused"),
]


@dataclass(frozen=True)
class FrontDoorConfig:
    master_url: str
    admin_key: str
    secret: bytes  # derives each sandbox's envd access token; shared by every replica
    domain: str | None = None  # the E2B_DOMAIN way: REST at api.<domain>, envd at 49983-<id>.<domain>
    create_wait_s: float = 300.0  # how long create waits for the guest to be validated (running)
    # A sandbox lives on this lease until its create's reply is on its way: a front door that dies mid-create
    # leaves a sandbox that CubeMaster times out within the lease (docs/decisions.md, issue 30 #7). Above the
    # front door's call to CubeMaster (30 s), which a create may spend waiting for capacity.
    create_lease_s: float = 60.0


def error(status: int, message: str, retry: bool = False) -> JSONResponse:
    """E2B's error body; `Should-Retry: false` so the SDK does not repeat a create that was refused, `true`
    where repeating it can help (the SDK then retries even a 409)."""
    headers = {"Should-Retry": "true" if retry else "false"}
    return JSONResponse(Error(code=status, message=message).body(), status_code=status, headers=headers)


def api_key(request: Request) -> str:
    key = request.headers.get("x-api-key")
    if not key:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        key = token.strip() if scheme.lower() == "bearer" else ""
    if not key:
        raise Refusal(401, "cubeaccel (api): missing API key (X-API-Key: a CubeMaster tenant key)")
    return key


def edge_error(e: CubeError) -> Response:
    """A refusal at the server edge (transport/api_edges.EdgeGuard, shared with CubeMaster and the Cubelet) in E2B's
    format: the catalogued code leads the message, as it does for CubeMaster's refusals."""
    refusal = M.refusal_from_error(e.to_json()["error"], http_status(e.code, e.status))
    return error(refusal.status, refusal.message, refusal.retry)


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


def create_app(cfg: FrontDoorConfig) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    master = FrontDoorMaster(cfg.master_url, cfg.admin_key)
    envd = EnvdProxy(master, cfg.secret, cfg.domain)

    def token(sandbox_id: str) -> str:
        return M.envd_token(cfg.secret, sandbox_id)

    async def sandbox(key: str, sandbox_id: str, wait_s: float = 0.0) -> SandboxReply:
        """`wait_s`: CubeMaster holds the reply until the sandbox settles (running, failed, gone), where it has
        `?wait=`; where it has not, the parameter is ignored and the caller polls."""
        return await master.call(Calls.sandbox(sandbox_id, round(wait_s, 1) if wait_s > 0 else None), key)

    async def live(key: str, sandbox_id: str) -> SandboxReply:
        """The caller's running sandbox, else 404 (gone, failed, or another tenant's: CubeMaster says 404)."""
        row = await sandbox(key, sandbox_id)
        if row.state != M.LIVE:
            raise Refusal(404, f"sandbox {sandbox_id} not found (it is {row.state})")
        return row

    async def create(request: Request) -> Response:
        key = api_key(request)
        req: NewSandbox = await body_of(request, NewSandbox)
        sid = f"{await master.id_prefix(key)}{uuid.uuid4().hex[:16]}"  # in the tenant's own id namespace
        body = M.create_body(req, sid, token(sid))
        asked_s = body.timeout_s or float(M.DEFAULT_TIMEOUT_S)  # create_body always sets it
        lease_s = min(asked_s, cfg.create_lease_s)
        body = body.model_copy(update={"timeout_s": lease_s})  # the client's lifetime: once its reply is ready
        t0 = time.monotonic()
        row = await master.call(Calls.create(body, request.headers.get("idempotency-key")), key)
        sid = row.id  # an idempotent repeat answers the first create's sandbox (its token: derived too)
        row = await wait_running(key, sid, row, lease_s)
        if asked_s > lease_s:
            row = await set_lifetime(key, sid, max(1.0, asked_s - (time.monotonic() - t0)))  # from the create
        return JSONResponse(
            M.created(row, token(sid), cfg.domain, M.traffic_token(cfg.secret, sid)).body(), status_code=201
        )

    async def set_lifetime(key: str, sid: str, timeout_s: float) -> SandboxReply:
        """The lifetime the client asked for; refused (a tenant's cap), the sandbox is deleted: nobody has it."""
        try:
            return await master.call(Calls.set_timeout(sid, timeout_s), key)
        except Refusal:
            with contextlib.suppress(Refusal):
                await master.call(Calls.delete(sid), key)
            raise

    async def wait_running(key: str, sid: str, row: SandboxReply, lease_s: float) -> SandboxReply:
        """Until the guest is validated: E2B's create returns a sandbox ready for commands. The create's lease
        is renewed every third of it meanwhile (a start may take longer than the lease)."""
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
            row = await sandbox(key, sid, wait_s=max(0.1, min(20.0, lease_s / 3, deadline - t0)))
            if time.monotonic() - t0 < pause:  # answered at once: a CubeMaster without `?wait=`, poll gently
                await asyncio.sleep(pause)
                pause = min(pause * 1.5, 0.25)
        return row

    async def connect(request: Request) -> Response:
        key = api_key(request)
        sid = request.path_params["sandbox_id"]
        req: ConnectBody = await body_of(request, ConnectBody, required=False)
        row = await live(key, sid)
        if req.timeout is not None and time.time() + req.timeout > (row.expires_at or 0.0):
            row = await master.call(Calls.set_timeout(sid, float(req.timeout)), key)
        return JSONResponse(
            M.created(row, token(sid), cfg.domain, M.traffic_token(cfg.secret, sid)).body(), status_code=200
        )

    async def get_info(request: Request) -> Response:
        key = api_key(request)
        sid = request.path_params["sandbox_id"]
        row = await live(key, sid)
        return JSONResponse(M.detail(row, token(sid), cfg.domain).body())

    async def list_sandboxes(request: Request) -> Response:
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
        reply = await master.call(Calls.sandboxes(M.LIVE), key)
        rows = M.select(reply.sandboxes, meta, states, after, newest_first)
        if q.get("template"):
            rows = [r for r in rows if M.template_name(r) == q["template"]]
        chunk, nxt = M.page(rows, limit, q.get("nextToken"), newest_first)
        headers = {"x-next-token": nxt} if nxt else {}
        return JSONResponse([M.listed(r).body() for r in chunk], headers=headers)

    async def metrics(request: Request) -> Response:
        """E2B's metrics of a running sandbox (404 otherwise): the guest's own samples, every 5 s for the last
        hour, within `start`/`end`; the newest carries the sandbox's devices (frontdoor/metrics.py)."""
        key = api_key(request)
        sid = request.path_params["sandbox_id"]
        try:
            start, end = window(request.query_params.get("start"), request.query_params.get("end"))
        except ValueError:
            raise Refusal(400, "cubeaccel (api): start and end are Unix seconds") from None
        row = await live(key, sid)
        guest = await envd.guest_metrics(sid)
        listed = await master.admin(Calls.node_devices(row.node or ""))
        devices = devices_of(row.device_ids, listed.devices, guest.devices)
        return JSONResponse(e2b_metrics(guest, start, end, devices))

    async def kill(request: Request) -> Response:
        key = api_key(request)
        sid = request.path_params["sandbox_id"]
        row = await sandbox(key, sid)
        if row.state in GONE:
            raise Refusal(404, f"sandbox {sid} not found (it is {row.state})")
        await master.call(Calls.delete(sid), key)
        return Response(status_code=204)

    async def set_timeout(request: Request) -> Response:
        key = api_key(request)
        sid = request.path_params["sandbox_id"]
        req: TimeoutBody = await body_of(request, TimeoutBody)
        await live(key, sid)
        await master.call(Calls.set_timeout(sid, max(1.0, req.timeout)), key)
        return Response(status_code=204)

    async def update_network(request: Request) -> Response:
        """E2B's `update_network`: the running sandbox's egress policy replaced whole, in place (CubeMaster records
        and audits it; the node loads it: docs/e2b.md)."""
        key = api_key(request)
        sid = request.path_params["sandbox_id"]
        req: NetworkUpdate = await body_of(request, NetworkUpdate, required=False)
        narrowing = M.network_update(req)
        await live(key, sid)
        await master.call(Calls.set_network(sid, narrowing), key)
        return Response(status_code=204)

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

    handlers = {
        "health": health,
        "create": create,
        "list": list_sandboxes,
        "get_info": get_info,
        "kill": kill,
        "set_timeout": set_timeout,
        "update_network": update_network,
        "metrics": metrics,
        "connect": connect,
        "refused": refused,
    }
    routes = [Route(path, handlers[name], methods=[method]) for method, path, name in REST_ROUTES]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await envd.aclose()
        await master.aclose()

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

    on_error = {Refusal: refusal, 404: no_route, 405: no_route, Exception: internal}
    rest = EdgeGuard(
        Starlette(routes=routes, lifespan=lifespan, exception_handlers=on_error),
        body_timeout_s=HttpLimits.from_env().body_timeout_s,
        render=edge_error,
        streams=lambda path: False,
    )

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
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
        await rest(scope, receive, send)

    return close_when_body_unread(app)


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
