"""Cubelet HTTP API (FastAPI) on a unix socket and optionally TCP: assembly of the routers in `cubelet/api/` with
the listener's gates, audit and parts. Shapes documented in docs/api.md."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI
from starlette.requests import Request
from starlette.responses import Response

from cubeaccel.cubelet.api import devices, events, local_only, node, reservations, warm_pools, workload
from cubeaccel.cubelet.api.deps import CubeletParts
from cubeaccel.cubelet.api.workload_upstreams import WorkloadUpstreams
from cubeaccel.cubelet.device_audit import DeviceAudit
from cubeaccel.cubelet.lifecycle import Cubelet
from cubeaccel.cubelet.metrics import metrics_of
from cubeaccel.cubelet.reconcile import reconcile
from cubeaccel.host.service.audit import AuditLog
from cubeaccel.host.service.throttle import Throttle
from cubeaccel.model.errors import CubeError
from cubeaccel.model.event_kinds import EventKind
from cubeaccel.transport import node_sig
from cubeaccel.transport.api_edges import BeforeReplyMiddleware, GateMiddleware, api_app, error_response
from cubeaccel.transport.http_server import PEER_KEY, run_servers, server_config
from cubeaccel.wire import cubelet_api as W
from cubeaccel.wire.reports import ShimReportBody

# Local mutations audited only when refused: a shim reports many times per sandbox; the journal keeps them all.
AUDIT_REFUSALS_ONLY = {"/v1/shim-reports"}

# Both listeners' routers, in the order the OpenAPI documents list their paths (docs/openapi/cubelet-*.json) and
# requests match them; the unix socket adds `local_only.router` last.
ROUTERS: tuple[APIRouter, ...] = (
    node.liveness,
    devices.router,
    reservations.create,
    warm_pools.router,
    reservations.router,
    events.router,
    node.router,
    workload.router,
    devices.verbs,
)


def create_app(
    cubelet: Cubelet,
    local: bool = True,
    token: str | Callable[[], str | None] | None = None,
    audit: AuditLog | None = None,
    peer_uids: frozenset[int] | None = None,
) -> FastAPI:
    """`local` (the unix socket, root-owned) also serves shim reports and reconcile; the TCP listener that
    CubeMaster uses does not, so nothing on the network can forge VM evidence. The TCP listener
    (`local=False`) answers only requests CubeMaster signed with this node's token, which forwards an admin's
    device verbs there (docs/security.md). `peer_uids`: on the unix socket, the uids a caller may have
    (SO_PEERCRED, read by the HTTP server); anyone else is refused, whatever the socket's file mode."""
    metrics = metrics_of(cubelet)
    app = api_app("cubeaccel Cubelet", body_models=(ShimReportBody,), telemetry=metrics.api)
    if not local:
        current = token if callable(token) else (lambda: token)
        if not current():
            raise ValueError("the Cubelet's TCP API needs the node token it accepts")
        throttle, nonces = Throttle(), node_sig.NonceCache()

        async def signed_by_master(request: Request) -> str | None:
            """None if CubeMaster signed this request's headers with the current node token, else why not. The
            body is checked against the signed hash by `signed_body`, once the edge guard has read it."""
            claim = node_sig.parse(request.headers.get("authorization"), request.headers.get(node_sig.BODY_HEADER))
            now = current()
            if claim is None or not now:
                return "the Cubelet's TCP API answers CubeMaster only (a CubeSig signature)"
            target = node_sig.target_of(request.url.path, request.url.query)
            why = node_sig.check(claim, now, request.method, target, nonces)
            if why is None:
                request.state.node_claim = claim
            return why

        async def signed_body(request: Request) -> None:
            claim = getattr(request.state, "node_claim", None)
            if claim is not None and not node_sig.body_matches(claim, await request.body()):
                raise CubeError("auth.invalid_credential", "the body is not the one signed", "api")

        app.router.dependencies.append(Depends(signed_body))

        async def only_master(request: Request) -> Response | None:
            # The workload proxy checks the sandbox's own access token (hashed in its checkpoint) instead.
            # /metrics: device states and counts, no sandbox or tenant names (a scraper holds no node token).
            exempt = (
                request.url.path in ("/v1/health", "/metrics")
                or workload.WORKLOAD_PATH.match(request.url.path) is not None
            )
            if not exempt and (why := await signed_by_master(request)) is not None:
                # Counted against the node the signature names, not the address (issue 30 #3); a valid one
                # never reaches this line.
                claim = node_sig.parse(request.headers.get("authorization"), None)
                presented = f"node:{claim.node[:64]}" if claim is not None else "unsigned"
                try:
                    throttle.check(presented)
                except CubeError as e:
                    return error_response(e)
                throttle.fail(presented)
                code = "auth.invalid_credential" if request.headers.get("authorization") else "auth.missing_credential"
                return error_response(CubeError(code, why, "api", {}, 401))
            return None

        app.add_middleware(GateMiddleware, gate=only_master)

    if local and peer_uids is not None:

        async def only_local_root(request: Request) -> Response | None:
            peer = request.scope.get(PEER_KEY)
            if peer is None or peer[1] in peer_uids:
                return None
            request.state.error_code = "auth.peer_not_allowed"
            return error_response(
                CubeError(
                    "auth.peer_not_allowed",
                    f"uid {peer[1]} may not use the Cubelet's socket (root or the Cubelet's own uid only)",
                    "api",
                    {"uid": peer[1]},
                )
            )

        app.add_middleware(GateMiddleware, gate=only_local_root)

    if audit is not None:
        who = "local-socket" if local else f"node-token:{cubelet.config.node_name} (CubeMaster)"

        async def audit_request(request: Request, status: int) -> None:
            """Device assignment (reserve/start), release, operator verbs, reconcile, and every refusal; written
            before the reply's status line is sent."""
            path, refused = request.url.path, status >= 400
            mutation = request.method not in ("GET", "HEAD", "OPTIONS") and path not in AUDIT_REFUSALS_ONLY
            if refused or mutation:
                creds = request.scope.get(PEER_KEY)  # the unix socket's caller, as the kernel says
                peer = {} if creds is None else {"peer_pid": creds[0], "peer_uid": creds[1]}
                await audit.append_async(
                    _action(request),
                    who if status != 401 else "anonymous",
                    "refused" if refused else "ok",
                    status=status,
                    reason=getattr(request.state, "error_code", None),
                    source=request.client.host if request.client else None,
                    request_id=getattr(request.state, "request_id", None) or request.headers.get("x-request-id"),
                    target=path,
                    node=cubelet.config.node_name,
                    **peer,
                    **getattr(request.state, "audit_fields", None) or _body_fields(request),
                )

        app.add_middleware(BeforeReplyMiddleware, hook=audit_request)

    # The journal's schema is migrated when the store opens, before any app exists; it cannot change after.
    healthy = W.Health(status="ok", node=cubelet.config.node_name, schema_version=cubelet.store.schema_version)
    CubeletParts(cubelet, local, metrics, healthy, WorkloadUpstreams(cubelet)).install(app)
    for router in ROUTERS:
        app.include_router(router)
    if local:
        app.include_router(local_only.router)
    return app


ACTIONS = {
    ("POST", "/v1/reservations"): "device:assign",
    ("POST", "/v1/reservations/{sandbox_id}/start"): "sandbox:start",
    ("DELETE", "/v1/reservations/{sandbox_id}"): "device:release",
    ("POST", "/v1/shim-reports"): "shim:report",
    ("POST", "/v1/reconcile"): "node:reconcile",
    ("POST", "/v1/warm/claim"): "sandbox:claim_warm",
    ("PUT", "/v1/warm/pools"): "node:warm_pool",
    ("POST", "/v1/warm/drain"): "node:warm_pool",
    ("POST", "/v1/warm/undrain"): "node:warm_pool",
}


def _body_fields(request: Request) -> dict[str, Any]:
    """A reservation refused for its contract at the edge is audited as one refused by the route: with its sandbox
    and tenant."""
    body = getattr(request.state, "refused_body", None)
    if request.url.path not in ("/v1/reservations", "/v1/warm/claim") or not isinstance(body, dict):
        return {}
    return {"sandbox": body.get("sandbox_id"), "tenant": body.get("tenant")}


def _action(request: Request) -> str:
    route = request.scope.get("route")
    path = str(getattr(route, "path", request.url.path))
    params = request.path_params
    if path == "/v1/devices/{device_id}/{verb}":
        return f"device:{params.get('verb')}"
    if path == "/v1/reservations/{sandbox_id}/{operation}":
        return f"sandbox:{params.get('operation')}"
    return ACTIONS.get((request.method, path), f"{request.method} {path}")


class Ticker:
    """Periodic reconcile (which also expires reservations and retries releases)."""

    def __init__(self, cubelet: Cubelet, interval_s: float, after_pass: Callable[[], object] | None = None) -> None:
        """`after_pass`: what follows each pass (the template snapshots' plan, when the devices changed)."""
        self.cubelet = cubelet
        self.interval_s = interval_s
        self.after_pass = after_pass
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cubelet-ticker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                reconcile(self.cubelet)
                if self.after_pass is not None:
                    self.after_pass()
            except Exception as e:  # a failed tick is logged as an event and retried next tick
                with self.cubelet.store.tx() as t:
                    t.event(EventKind.RECONCILE_FAILED, "cubelet", reason=type(e).__name__, details={"error": str(e)})


def local_uids() -> frozenset[int]:
    """Who may use the unix socket: root and the Cubelet's own uid (the shims it starts run as that uid)."""
    return frozenset({0, os.geteuid()})


def serve(
    cubelet: Cubelet,
    socket_path: Path,
    listen: tuple[str, int] | None,
    token: str | Callable[[], str | None] | None = None,
    on_serving: Callable[[], None] | None = None,
) -> None:
    """Serve the unix socket (and `listen`); `on_serving` runs once every listener accepts connections."""
    import uvicorn

    audit = AuditLog(socket_path.parent / "audit.jsonl")  # next to the store: the state dir
    cubelet.audit = audit  # host changes for sandboxes (their networks) are audited beside the requests
    cubelet.device_audit = DeviceAudit(audit, cubelet.config.node_name)  # and each device's custody (who had it)
    cubelet.store.listeners.append(cubelet.device_audit)
    socket_path.unlink(missing_ok=True)
    socket_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    # Bound here, not by uvicorn, which chmods a unix socket it creates to 0666: this one takes shim reports
    # (VM evidence) and operator verbs, so only its owner may connect.
    local = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        local.bind(str(socket_path))
    finally:
        os.umask(old)
    os.chmod(socket_path, 0o600)
    local_app = create_app(cubelet, local=True, audit=audit, peer_uids=local_uids())
    configs = [server_config(local_app, fd=local.fileno())]
    if listen is not None:
        configs.append(
            server_config(create_app(cubelet, local=False, token=token, audit=audit), host=listen[0], port=listen[1])
        )
    servers = [uvicorn.Server(c) for c in configs]

    async def run() -> None:
        from cubeaccel.host.service import sdnotify

        status = f"cubelet {cubelet.config.node_name}: serving {socket_path}"
        await asyncio.gather(*(s.serve() for s in servers), sdnotify.when_started(servers, status, on_serving))

    run_servers(run(), configs[0])
