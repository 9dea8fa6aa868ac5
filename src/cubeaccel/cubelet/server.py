"""Cubelet HTTP API (FastAPI) on a unix socket and optionally TCP: assembly of the routers in `cubelet/api/` with
the listener's gates, audit and parts. Shapes documented in docs/api.md."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI

from cubeaccel.cubelet.api import devices, events, local_only, node, reservations, warm_pools, workload
from cubeaccel.cubelet.api.audit import RequestAudit
from cubeaccel.cubelet.api.deps import CubeletParts
from cubeaccel.cubelet.api.gates import LocalPeers, MasterOnly, signed_body
from cubeaccel.cubelet.api.workload_upstreams import WorkloadUpstreams
from cubeaccel.cubelet.lifecycle import Cubelet
from cubeaccel.cubelet.metrics import CubeletMetrics
from cubeaccel.cubelet.reconcile import reconcile
from cubeaccel.host.service.audit import AuditLog
from cubeaccel.model.event_kinds import EventKind
from cubeaccel.transport.api_edges import BeforeReplyMiddleware, GateMiddleware, api_app
from cubeaccel.transport.http_server import run_servers, server_config
from cubeaccel.wire import cubelet_api as W
from cubeaccel.wire.reports import ShimReportBody

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
    metrics: CubeletMetrics | None = None,
) -> FastAPI:
    """`local` (the unix socket, root-owned) also serves shim reports and reconcile; the TCP listener that
    CubeMaster uses does not, so nothing on the network can forge VM evidence. The TCP listener
    (`local=False`) answers only requests CubeMaster signed with this node's token, which forwards an admin's
    device verbs there (docs/security.md). `peer_uids`: on the unix socket, the uids a caller may have
    (SO_PEERCRED, read by the HTTP server); anyone else is refused, whatever the socket's file mode. `metrics`:
    the node's, built by the composition root and shared by both listeners (None: this app's own)."""
    metrics = metrics if metrics is not None else CubeletMetrics(cubelet)
    app = api_app("cubeaccel Cubelet", body_models=(ShimReportBody,), telemetry=metrics.api)
    if not local:
        current = token if callable(token) else (lambda: token)
        if not current():
            raise ValueError("the Cubelet's TCP API needs the node token it accepts")
        app.router.dependencies.append(Depends(signed_body))  # before the routers: each route copies them
        app.add_middleware(GateMiddleware, gate=MasterOnly(current))
    if local and peer_uids is not None:
        app.add_middleware(GateMiddleware, gate=LocalPeers(peer_uids))
    if audit is not None:
        who = "local-socket" if local else f"node-token:{cubelet.config.node_name} (CubeMaster)"
        app.add_middleware(BeforeReplyMiddleware, hook=RequestAudit(audit, who, cubelet.config.node_name))

    # The journal's schema is migrated when the store opens, before any app exists; it cannot change after.
    healthy = W.Health(status="ok", node=cubelet.config.node_name, schema_version=cubelet.store.schema_version)
    CubeletParts(cubelet, local, metrics, healthy, WorkloadUpstreams(cubelet)).install(app)
    for router in ROUTERS:
        app.include_router(router)
    if local:
        app.include_router(local_only.router)
    return app


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
    metrics: CubeletMetrics,
    audit: AuditLog,
    socket_path: Path,
    listen: tuple[str, int] | None,
    token: str | Callable[[], str | None] | None = None,
    on_serving: Callable[[], None] | None = None,
) -> None:
    """Serve the unix socket (and `listen`); `on_serving` runs once every listener accepts connections. `audit`:
    the log the Cubelet was built with (host changes, device custody): the requests are audited beside them."""
    import uvicorn

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
    local_app = create_app(cubelet, local=True, audit=audit, peer_uids=local_uids(), metrics=metrics)
    configs = [server_config(local_app, fd=local.fileno())]
    if listen is not None:
        configs.append(
            server_config(
                create_app(cubelet, local=False, token=token, audit=audit, metrics=metrics),
                host=listen[0],
                port=listen[1],
            )
        )
    servers = [uvicorn.Server(c) for c in configs]

    async def run() -> None:
        from cubeaccel.host.service import sdnotify

        status = f"cubelet {cubelet.config.node_name}: serving {socket_path}"
        await asyncio.gather(*(s.serve() for s in servers), sdnotify.when_started(servers, status, on_serving))

    run_servers(run(), configs[0])
