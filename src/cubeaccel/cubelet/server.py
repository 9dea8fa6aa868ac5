"""Cubelet HTTP API (FastAPI) on a unix socket and optionally TCP. Shapes documented in docs/api.md."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from fastapi import Depends, FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from cubeaccel.cubelet import network_update, operator
from cubeaccel.cubelet.capacity import capacity_summary
from cubeaccel.cubelet.heartbeat import held, host_state
from cubeaccel.cubelet.lifecycle import Cubelet, ReservationRequest, validate_sandbox_id
from cubeaccel.cubelet.metrics import CubeletMetrics
from cubeaccel.cubelet.reconcile import reconcile
from cubeaccel.cubelet.store import Event, Reservation
from cubeaccel.cubelet.warm import refuse_reserved_id
from cubeaccel.host.service.audit import AuditLog
from cubeaccel.host.service.throttle import Throttle
from cubeaccel.host.service.unix_path import connect_path
from cubeaccel.model.cold_start import cold_start_phases, start_path
from cubeaccel.model.event_kinds import EventKind
from cubeaccel.model.lifecycle_ops import refuse
from cubeaccel.model.pinned_memory import QEMU_LOCKED_PER_VCPU_MIB
from cubeaccel.model.reservation_states import ReservationPhase
from cubeaccel.protocol.connect_envelope import FLAG_END_STREAM, HEADER, encode_json
from cubeaccel.protocol.errors import CubeError, invalid, not_found
from cubeaccel.transport import node_sig, proxy
from cubeaccel.transport.api_edges import BeforeReplyMiddleware, GateMiddleware, api_app, error_response, json_body
from cubeaccel.transport.http_server import PEER_KEY, run_servers, server_config
from cubeaccel.wire import cubelet_api as W
from cubeaccel.wire.capacity import CapacitySummary
from cubeaccel.wire.dashboard import DashboardEvent, DashboardSandbox, NodeDashboard
from cubeaccel.wire.reports import ShimReportBody, parse_report
from cubeaccel.wire.warm import WarmClaimBody, WarmDrainReply, WarmPoolBody, WarmPoolList

# Local mutations audited only when refused: a shim reports many times per sandbox; the journal keeps them all.
AUDIT_REFUSALS_ONLY = {"/v1/shim-reports"}


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
                request.url.path in ("/v1/health", "/metrics") or _WORKLOAD_PATH.match(request.url.path) is not None
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

    def dev(device_id: str) -> W.DeviceReply:
        d = cubelet.store.device(device_id)
        if d is None:
            raise not_found("device.not_found", f"no device {device_id!r}")
        return W.DeviceReply.of(d)

    # The journal's schema is migrated when the store opens, before any app exists; it cannot change after.
    healthy = W.Health(status="ok", node=cubelet.config.node_name, schema_version=cubelet.store.schema_version)

    @app.get("/v1/health", response_model=W.Health)
    async def health() -> W.Health:
        """On the event loop: a liveness probe needs no worker thread (and no store read)."""
        return healthy

    @app.get("/v1/devices", response_model=W.DeviceList)
    def devices() -> W.DeviceList:
        return W.DeviceList(devices=[W.Device.of(d) for d in cubelet.store.devices()])

    @app.get("/v1/devices/{device_id}", response_model=W.DeviceReply)
    def device(device_id: str) -> W.DeviceReply:
        return dev(device_id)

    verbs = {
        "quarantine": operator.quarantine,
        "recover": operator.recover,
        "disable": operator.disable,
        "enable": operator.enable,
    }

    def device_verb(device_id: str, verb: str, body: W.OperatorBody) -> W.DeviceReply:
        fn = verbs.get(verb)
        if fn is None:
            raise not_found("api.unknown_verb", f"unknown device verb {verb!r}; known: {sorted(verbs)}")
        dev(device_id)
        if verb == "disable":
            return W.DeviceReply.of(operator.disable(cubelet, device_id, body.who, body.reason, body.restore_driver))
        return W.DeviceReply.of(fn(cubelet, device_id, body.who, body.reason))

    # The hot routes are async with one worker-thread hand-off for the blocking work: a sync route would take
    # a second one just to check its reply against the response model.
    @app.post("/v1/reservations", status_code=201, response_model=W.ReservationView)
    async def create_reservation(body: W.ReservationBody, request: Request) -> W.ReservationView:
        request.state.audit_fields = {"sandbox": body.sandbox_id, "tenant": body.tenant}  # the request's own entry
        return await run_in_threadpool(reserve_now, body)

    def reserve_now(body: W.ReservationBody) -> W.ReservationView:
        req = _request(body)
        try:
            cubelet.reserve(refuse_reserved_id(body.sandbox_id), req, capacity_wait_s=body.capacity_wait_s or 0.0)
        except CubeError as e:
            metrics.refused(e.code)
            raise
        if body.start:
            cubelet.start(body.sandbox_id, body.workload_token.get_secret_value() if body.workload_token else None)
        return reservation_view(cubelet, body.sandbox_id, local, access_token=cubelet.take_token(body.sandbox_id))

    # ---- warm sandboxes (docs/warm.md) ----
    @app.post("/v1/warm/claim", status_code=201, response_model=W.ReservationView)
    async def claim_warm(body: WarmClaimBody, request: Request) -> W.ReservationView:
        """A reservation request served only from the node's warm pool: 201 and the running sandbox with its
        workload token, or 409 `warm.no_match` with `details.reason` (the caller takes the cold path)."""
        request.state.audit_fields = {"sandbox": body.sandbox_id, "tenant": body.tenant}
        return await run_in_threadpool(claim_now, body)

    def claim_now(body: WarmClaimBody) -> W.ReservationView:
        given = body.workload_token.get_secret_value() if body.workload_token else None
        _, token, ack = cubelet.warm.claim(body.sandbox_id, _request(body), given, body.warm_id)
        hand_off = W.WarmHandOff(reseed_ms=ack.reseed_ms, rebind_ms=ack.rebind_ms, reseeded=ack.reseeded)
        return reservation_view(cubelet, body.sandbox_id, local, access_token=token, hand_off=hand_off)

    @app.get("/v1/warm/pools", response_model=WarmPoolList)
    def warm_pools() -> WarmPoolList:
        warm = cubelet.warm
        return WarmPoolList(
            pools=warm.views(), max_concurrent_starts=warm.max_concurrent_starts, draining=warm.draining
        )

    @app.post("/v1/warm/drain", response_model=WarmDrainReply)
    def drain_warm() -> WarmDrainReply:
        return WarmDrainReply(draining=True, torn_down=cubelet.warm.drain())

    @app.post("/v1/warm/undrain", response_model=WarmDrainReply)
    def undrain_warm() -> WarmDrainReply:
        cubelet.warm.undrain()
        return WarmDrainReply(draining=False, torn_down=[])

    @app.put("/v1/warm/pools", response_model=WarmPoolList)
    def set_warm_pool(body: WarmPoolBody) -> WarmPoolList:
        cubelet.warm.set_pool(cubelet.pool_request(body), body.size)
        return warm_pools()

    @app.get("/v1/reservations", response_model=W.ReservationList)
    def reservations() -> W.ReservationList:
        return W.ReservationList(reservations=[_view(r, local) for r in cubelet.store.reservations()])

    @app.get("/v1/reservations/{sandbox_id}", response_model=W.ReservationView)
    def reservation(sandbox_id: str) -> W.ReservationView:
        cubelet.get_reservation(sandbox_id)
        return reservation_view(cubelet, sandbox_id, local)

    @app.post("/v1/reservations/{sandbox_id}/start", response_model=W.ReservationView)
    def start(sandbox_id: str) -> W.ReservationView:
        cubelet.start(validate_sandbox_id(sandbox_id))
        return reservation_view(cubelet, sandbox_id, local, access_token=cubelet.take_token(sandbox_id))

    @app.put("/v1/reservations/{sandbox_id}/network", response_model=W.ReservationView)
    def set_network(sandbox_id: str, body: W.NetworkUpdateBody) -> W.ReservationView:
        """A running sandbox's egress policy, changed in place: journaled, then loaded as one nft transaction
        (cubelet/network_update.py); the reservation with its new effective policy."""
        network_update.set_network(cubelet, validate_sandbox_id(sandbox_id), body.network)
        return reservation_view(cubelet, sandbox_id, local)

    @app.post("/v1/reservations/{sandbox_id}/{operation}")
    def lifecycle_operation(sandbox_id: str, operation: str) -> dict[str, Any]:
        """snapshot, clone, rollback, pause, resume, live_migration: refused for a sandbox holding a device."""
        res = cubelet.get_reservation(sandbox_id)
        raise refuse(operation, res.sandbox_id, has_accelerator=bool(res.device_ids))

    @app.delete("/v1/reservations/{sandbox_id}", status_code=202, response_model=W.Release)
    async def delete_reservation(sandbox_id: str) -> W.Release:
        return await run_in_threadpool(release_now, sandbox_id)

    def release_now(sandbox_id: str) -> W.Release:
        return _release_view(cubelet, sandbox_id, cubelet.release(sandbox_id), local)

    def shim_report(body: dict[str, Any]) -> W.Accepted:
        try:
            report = parse_report(body)
        except ValueError as e:
            raise invalid("api.invalid_shim_report", f"invalid shim report: {e}") from e
        validate_sandbox_id(report.sandbox_id)
        cubelet.handle_report(report)
        return W.Accepted(accepted=True)

    @app.get("/v1/events", response_model=W.EventPage)
    def events(
        since: int = 0, limit: int = 1000, device_id: str | None = None, sandbox_id: str | None = None
    ) -> W.EventPage:
        if not 0 <= since < 2**62 or not 1 <= limit <= 10000:
            raise invalid("api.invalid_cursor", "since must be ≥ 0 and limit 1..10000")
        if sandbox_id is not None:
            validate_sandbox_id(sandbox_id)
        evs = cubelet.store.events(since, limit, device_id, sandbox_id=sandbox_id)
        return W.EventPage(events=[_event(e) for e in evs], next=evs[-1].seq if evs else since)

    @app.get("/v1/host", response_model=W.HostReply)
    def host() -> W.HostReply:
        """Host readiness (the backend's host-wide checks) and the pinned-memory ledger."""
        readiness, led = host_state(cubelet)
        return W.HostReply(
            node=cubelet.config.node_name,
            backend=cubelet.backend.name,
            ready=readiness.ready,
            checked_at=readiness.checked_at,
            problems=[W.HostProblem(code=p.code, message=p.message) for p in (*readiness.problems, *held(cubelet))],
            pinned_memory=W.PinnedMemory(
                lockable_mib=led.lockable_mib,
                locked_mib=led.locked_mib,
                free_mib=led.free_mib,
                source=led.source,
                per_vmm_limit_mib=led.per_vmm_limit_mib,
                vmm_overhead_mib=led.vmm_overhead_mib,
                vmm_overhead_per_vcpu_mib=QEMU_LOCKED_PER_VCPU_MIB,
                sandboxes=dict(led.by_sandbox),
            ),
        )

    @app.get("/v1/capacity", response_model=CapacitySummary)
    def capacity() -> CapacitySummary:
        return capacity_summary(cubelet.store.devices(), cubelet.config.node_name, [cubelet.backend.name])

    @app.get("/metrics", include_in_schema=False)
    def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/dashboard", response_model=NodeDashboard)
    def dashboard(events: int = 50) -> NodeDashboard:
        """Devices, reservations with their cold-start waterfall, and the newest events: CubeMaster's page."""
        return dashboard_view(cubelet, max(0, min(events, 500)))

    def run_reconcile() -> W.Repairs:
        repairs = reconcile(cubelet)
        return W.Repairs(
            repairs=[W.Repair(device_id=r.device_id, sandbox_id=r.sandbox_id, what=r.what, why=r.why) for r in repairs]
        )

    add_workload_proxy(app, cubelet)
    app.post("/v1/devices/{device_id}/{verb}", response_model=W.DeviceReply)(device_verb)
    if local:
        app.post(
            "/v1/shim-reports", status_code=202, response_model=W.Accepted, openapi_extra=json_body("ShimReportBody")
        )(shim_report)
        app.post("/v1/reconcile", response_model=W.Repairs)(run_reconcile)
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


def _request(body: W.ReservationBody) -> ReservationRequest:
    return ReservationRequest(
        count=body.count,
        accel_class=body.accel_class,
        labels=tuple(sorted(body.labels.items())),
        template=body.template,
        memory_mib=body.memory_mib,
        vcpus=body.vcpus,
        pin_memory=body.pin_memory,
        contract=body.contract,
        lifetime_s=body.lifetime_s,
        network=body.network,
        tenant=body.tenant,
    )


def _action(request: Request) -> str:
    route = request.scope.get("route")
    path = str(getattr(route, "path", request.url.path))
    params = request.path_params
    if path == "/v1/devices/{device_id}/{verb}":
        return f"device:{params.get('verb')}"
    if path == "/v1/reservations/{sandbox_id}/{operation}":
        return f"sandbox:{params.get('operation')}"
    return ACTIONS.get((request.method, path), f"{request.method} {path}")


def _view(res: Reservation, local: bool) -> W.Reservation:
    """A reservation as served. The start nonce (`facts.start_id`) is what makes a shim report count: it goes
    to the shim in its spec and is shown on the root-only unix socket, never over TCP."""
    facts = W.LocalCheckpoint.of(res.checkpoint) if local else W.Checkpoint.of(res.checkpoint)
    return W.Reservation(
        sandbox_id=res.sandbox_id,
        params=W.ReservationParamsShown.of(res.params),
        device_ids=res.device_ids,
        phase=res.phase,
        created_at=res.created_at,
        expires_at=res.expires_at,
        facts=facts,
        releasing_since=res.releasing_since,
    )


def _event(e: Event) -> W.Event:
    return W.Event(
        seq=e.seq,
        at=e.at,
        kind=e.kind,
        device_id=e.device_id,
        sandbox_id=e.sandbox_id,
        event=e.event,
        from_state=e.from_state,
        to_state=e.to_state,
        actor=e.actor,
        reason=e.reason,
        details=e.details,
    )


def reservation_view(
    cubelet: Cubelet,
    sandbox_id: str,
    local: bool = True,
    access_token: str | None = None,
    hand_off: W.WarmHandOff | None = None,
) -> W.ReservationView:
    """A sandbox's reservation, devices, timeline and failure, from one snapshot (they agree)."""
    with cubelet.store.read() as t:
        res = t.reservation(sandbox_id)
        devs = [W.Device.of(d) for d in t.devices_of(sandbox_id)]
        timeline = [W.TimelineEntry(**row) for row in t.timeline(sandbox_id)]
        failure = _failure(res, t.last_closed(sandbox_id) if res is None else None)
    return W.ReservationView(
        sandbox_id=sandbox_id,
        reservation=None if res is None else _view(res, local),
        devices=devs,
        timeline=timeline,
        failure=failure,
        access_token=access_token,
        hand_off=hand_off,
    )


def _release_view(cubelet: Cubelet, sandbox_id: str, res: Reservation | None, local: bool) -> W.Release:
    """A DELETE's reply: the devices only (no timeline read to be dropped)."""
    with cubelet.store.read() as t:
        devs = [W.Device.of(d) for d in t.devices_of(sandbox_id)]
    return W.Release(
        sandbox_id=sandbox_id,
        released=res is None,
        reservation=None if res is None else _view(res, local),
        devices=devs,
    )


def dashboard_view(cubelet: Cubelet, n_events: int) -> NodeDashboard:
    sandboxes = []
    for r in cubelet.store.reservations():
        events = cubelet.store.events(0, 10000, sandbox_id=r.sandbox_id)
        sandboxes.append(
            DashboardSandbox(
                sandbox_id=r.sandbox_id,
                phase=r.phase,
                device_ids=r.device_ids,
                created_at=r.created_at,
                phases=cold_start_phases((e.kind, e.event, e.at) for e in events),
                start=start_path((e.kind, e.event, e.details) for e in events),
            )
        )
    return NodeDashboard(
        node=cubelet.config.node_name,
        devices=[W.Device.of(d) for d in cubelet.store.devices()],
        sandboxes=sandboxes,
        events=[
            DashboardEvent(
                seq=e.seq,
                at=e.at,
                kind=e.kind,
                device_id=e.device_id,
                sandbox_id=e.sandbox_id,
                event=e.event,
                from_state=e.from_state,
                to_state=e.to_state,
                actor=e.actor,
                reason=e.reason,
            )
            for e in cubelet.store.latest_events(n_events)
        ],
    )


def _failure(res: Reservation | None, closed: dict[str, Any] | None) -> W.Failure | None:
    """The live reservation's failure, or the one its `reservation_closed` event kept."""
    if res is not None:
        return None if res.checkpoint.failure is None else W.Failure.of(res.checkpoint.failure)
    failure = closed.get("facts", {}).get("failure") if closed else None
    return W.Failure.model_validate(failure) if isinstance(failure, dict) else None


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


# ---- the workload proxy ------------------------------------------------------------------------------------------
WORKLOAD_PREFIX = "/v1/sandboxes/"  # + {sandbox_id}/workload/{path}: envd's API of that sandbox, streamed through
_WORKLOAD_PATH = re.compile(r"^/v1/sandboxes/[^/]+/workload/")
WORKLOAD_METHODS = ("GET", "POST", "HEAD", "PUT", "PATCH", "DELETE", "OPTIONS")  # the last four: ports only
PORT_PATH = "cubeaccel/port/"  # …/workload/cubeaccel/port/<port>/<path>: another port of the sandbox


def workload_socket(cubelet: Cubelet, sandbox_id: str) -> Path:
    """The running sandbox's bridge socket, or the refusal a caller gets."""
    res = cubelet.store.reservation(sandbox_id)
    if res is None or res.phase is not ReservationPhase.RUNNING:
        raise CubeError(
            "workload.not_running", f"sandbox {sandbox_id} is not running here", "api", {"sandbox_id": sandbox_id}
        )
    path = cubelet.shim.workload_socket(res.shim_id)  # a claimed warm sandbox's shim keeps its own id
    if not isinstance(path, Path) or not path.exists():
        raise CubeError(
            "workload.unavailable",
            f"sandbox {sandbox_id} has no workload endpoint",
            "api",
            {"sandbox_id": sandbox_id},
        )
    return path


class WorkloadUpstreams:
    """One pooled httpx client per running sandbox (and event loop): keep-alive connections on the shim's
    `workload.sock`, so a call reuses an idle connection (one mux stream that the guest keeps serving) instead
    of a new unix connection, mux stream and HTTP connection each time. A client whose socket path changed is
    replaced; sandboxes that stopped running are swept when the cache grows."""

    MAX_CONNECTIONS = 256  # the bridge's stream cap: beyond it a connection would be refused anyway
    KEEPALIVE = 16
    KEEPALIVE_S = 30.0
    SWEEP_ABOVE = 64

    def __init__(self, cubelet: Cubelet) -> None:
        self._cubelet = cubelet
        self._clients: dict[tuple[str, int], tuple[Path, httpx.AsyncClient]] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def get(self, sandbox_id: str, sock: Path) -> httpx.AsyncClient:
        key = (sandbox_id, id(asyncio.get_running_loop()))
        found = self._clients.get(key)
        if found is not None and found[0] == sock and not found[1].is_closed:
            return found[1]
        if found is not None:
            self._retire(found[1])
        if len(self._clients) >= self.SWEEP_ABOVE:
            self._sweep()
        limits = httpx.Limits(
            max_connections=self.MAX_CONNECTIONS,
            max_keepalive_connections=self.KEEPALIVE,
            keepalive_expiry=self.KEEPALIVE_S,
        )
        client = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=connect_path(sock), limits=limits),
            base_url="http://workload",
            timeout=httpx.Timeout(None, connect=10.0),
        )
        self._clients[key] = (sock, client)
        return client

    def drop(self, sandbox_id: str) -> None:
        for key in [k for k in self._clients if k[0] == sandbox_id]:
            self._retire(self._clients.pop(key)[1])

    def _sweep(self) -> None:
        loop = id(asyncio.get_running_loop())
        for key in list(self._clients):
            res = self._cubelet.store.reservation(key[0])
            if key[1] != loop or res is None or res.phase is not ReservationPhase.RUNNING:
                self._retire(self._clients.pop(key)[1])

    def _retire(self, client: httpx.AsyncClient) -> None:
        with contextlib.suppress(RuntimeError):  # its loop is gone: nothing left to close there
            task = asyncio.get_running_loop().create_task(client.aclose())
            self._closing.add(task)  # held until done: the loop keeps only a weak reference to a task
            task.add_done_callback(self._closing.discard)


class _EnvelopeTracker:
    """Follows Connect envelope boundaries in a streamed reply, so that when the guest's side breaks
    mid-stream the proxy can end the stream with a clear error envelope instead of a cut connection (only
    at a boundary; inside an envelope there is nothing valid left to append)."""

    def __init__(self) -> None:
        self._need = HEADER.size  # bytes until the next boundary event
        self._header = True
        self._head = bytearray()
        self.ended = False  # an end-of-stream envelope passed

    def feed(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            take = min(self._need, len(view))
            if self._header:
                self._head += view[:take]
            view, self._need = view[take:], self._need - take
            if self._need:
                continue
            if self._header:
                flags, length = HEADER.unpack(self._head)
                self.ended = self.ended or bool(flags & FLAG_END_STREAM)
                self._head.clear()
                self._header, self._need = False, length
                if length:
                    continue
            self._header, self._need = True, HEADER.size

    @property
    def at_boundary(self) -> bool:
        return self._header and self._need == HEADER.size and not self.ended


def _still_running(cubelet: Cubelet, sandbox_id: str) -> bool:
    res = cubelet.store.reservation(sandbox_id)
    return res is not None and res.phase is ReservationPhase.RUNNING


def _end_of_stream_error(code: str, message: str) -> bytes:
    return encode_json({"error": {"code": code, "message": message}}, FLAG_END_STREAM)


def _port_target(request: Request) -> str:
    """Where a request to another port of the sandbox goes (the guest forwards it: workload/portforward.py):
    the caller's path and query as sent, not re-encoded."""
    raw = request.scope.get("raw_path") or request.url.path.encode()
    target = raw.decode("latin-1").split("/workload", 1)[1]
    if request.url.query:
        target += "?" + request.url.query
    return target


def add_workload_proxy(app: FastAPI, cubelet: Cubelet) -> None:
    """Route `…/{sandbox_id}/workload/{path}` to that sandbox's shim socket, bodies streamed both ways (never
    buffered whole). The caller's `X-Access-Token` is checked against the start's stored hash here, and again by
    the guest; `GET health` and envd's signed `/files` URLs pass to the guest, which checks them. Upstream
    connections are pooled per sandbox (`WorkloadUpstreams`)."""
    upstreams = WorkloadUpstreams(cubelet)
    app.state.workload_upstreams = upstreams

    @app.api_route(
        WORKLOAD_PREFIX + "{sandbox_id}/workload/{path:path}",
        methods=list(WORKLOAD_METHODS),
        include_in_schema=False,
    )
    async def workload(sandbox_id: str, path: str, request: Request) -> Response:
        validate_sandbox_id(sandbox_id)
        token = request.headers.get("x-access-token")
        if token is not None:
            if not cubelet.workload_token_ok(sandbox_id, token):
                raise CubeError("workload.unauthenticated", "missing or wrong access token", "api")
        elif not (path == "health" or (path == "files" and "signature" in request.query_params)):
            raise CubeError("workload.unauthenticated", "missing or wrong access token", "api")
        sock = workload_socket(cubelet, sandbox_id)
        client = upstreams.get(sandbox_id, sock)
        headers = proxy.request_headers(request)
        try:
            if path.startswith(PORT_PATH):
                upstream = await proxy.send(client, request, _port_target(request), headers, framed=True)
            else:
                url = httpx.URL("/" + path, params=list(request.query_params.multi_items()))
                upstream = await proxy.send(client, request, url, headers)
        except httpx.HTTPError as e:
            upstreams.drop(sandbox_id)  # its pooled connections may all be dead (the bridge reconnected)
            raise CubeError("workload.unavailable", f"workload endpoint: {e}", "api") from e
        connect_stream = upstream.headers.get("content-type", "").startswith("application/connect+")
        tracker = _EnvelopeTracker()

        def broke(e: httpx.HTTPError) -> bytes | None:
            upstreams.drop(sandbox_id)
            if not (connect_stream and tracker.at_boundary) or not _still_running(cubelet, sandbox_id):
                # A sandbox being torn down ends its streams as E2B's do when a sandbox is killed: the
                # connection is cut, and the SDK's health probe (502, gone) tells it the sandbox was killed.
                return None
            code = "workload.channel_closed"  # ours, in the message; the Connect code is envd's vocabulary
            return _end_of_stream_error("unavailable", f"{code}: the sandbox's workload channel broke mid-stream ({e})")

        return proxy.Relay(upstream, observe=tracker.feed if connect_stream else None, on_error=broke)
