"""CubeMaster HTTP API (FastAPI): users, operators and Cubelet heartbeats. Shapes in docs/master.md.

Errors have the Cubelet's format: `{"error": {"code", "layer", "message", "details"}}` with a status.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
from fastapi import Depends, FastAPI, Query, Request, Response
from fastapi.responses import HTMLResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers, MutableHeaders
from starlette.routing import BaseRoute

from cubeaccel.host.service.audit import AuditLog
from cubeaccel.master import sandbox_network
from cubeaccel.master.auth import (
    ADMIN,
    ANON,
    ANONYMOUS,
    DEFAULT_TENANT,
    NODE,
    TENANT,
    DatabaseSeal,
    Identity,
    SignedRequest,
    audit_seals,
    forbidden,
)
from cubeaccel.master.dashboard import PAGE, DashboardFeed
from cubeaccel.master.maintenance import Maintenance, reconcile_node
from cubeaccel.master.metrics import metrics_of
from cubeaccel.master.node_truth import NodeTruth, silent_nodes
from cubeaccel.master.records import Quota, SandboxRow
from cubeaccel.master.service import CreateSpec, CubeMaster, sandbox_error, sandbox_record
from cubeaccel.master.warm import WARM_STATE, warm_rows
from cubeaccel.model.errors import CubeError
from cubeaccel.model.ids import NODE_ID_RE, SANDBOX_ID_RE
from cubeaccel.model.request import AcceleratorRequest, for_template, parse_accelerators, parse_shorthand
from cubeaccel.model.sandbox_states import SETTLED_STATES, NodeEvent, NodeState, SandboxActor, SandboxState
from cubeaccel.transport import node_sig
from cubeaccel.transport.api_edges import BeforeReplyMiddleware, api_app, json_body
from cubeaccel.transport.cubelet_client import CubeletClient
from cubeaccel.transport.telemetry import accept_request_id
from cubeaccel.wire import master_api as W
from cubeaccel.wire.dashboard import Dashboard
from cubeaccel.wire.heartbeat import Heartbeat, NodeNews
from cubeaccel.wire.master_api import OperatorBody, SandboxBody
from cubeaccel.wire.templates import TemplateDocument
from cubeaccel.wire.warm import WarmDrainReply, WarmVerbFailure

SANDBOX_STATES = tuple(s.value for s in SandboxState)
DEVICE_VERBS = frozenset({"quarantine", "recover", "disable", "enable"})
MAX_IDEMPOTENCY_KEY = 200  # the body field's bound and the column's width
MAX_WAIT_S = 600.0  # `?wait=` on create and show: the longest a request is held open
WAIT_POLL_S = 0.1

PUBLIC = frozenset({ANONYMOUS, ADMIN, TENANT, NODE})
USERS = frozenset({ADMIN, TENANT})
ADMINS = frozenset({ADMIN})
NODES = frozenset({NODE})

# Who may call each route, and the action name the audit log gives it. A route with no row is refused with
# 500 `auth.no_policy` (fail closed), and tests/unit/test_auth_routes.py fails for it.
POLICY: dict[tuple[str, str], tuple[frozenset[str], str]] = {
    ("GET", "/v1/health"): (PUBLIC, "health"),
    ("GET", "/v1/whoami"): (PUBLIC - {ANONYMOUS}, "whoami"),
    ("PUT", "/v1/nodes/{node}"): (NODES, "node:heartbeat"),
    ("PUT", "/v1/nodes/{node}/sandboxes/{sandbox_id}/status"): (NODES, "node:sandbox_status"),
    ("GET", "/v1/nodes"): (ADMINS, "node:list"),
    ("GET", "/v1/nodes/{node}"): (ADMINS, "node:show"),
    ("POST", "/v1/nodes/{node}/{verb}"): (ADMINS, "node:verb"),
    ("GET", "/v1/nodes/{node}/devices"): (ADMINS, "device:list"),
    ("POST", "/v1/nodes/{node}/devices/{device_id}/{verb}"): (ADMINS, "device:verb"),  # audited as device:<verb>
    ("POST", "/v1/nodes/{node}/credential"): (ADMINS, "node:enrol"),
    ("DELETE", "/v1/nodes/{node}/credential"): (ADMINS, "node:revoke"),
    ("GET", "/v1/capacity"): (USERS, "capacity"),
    ("POST", "/v1/templates"): (ADMINS, "template:register"),
    ("GET", "/v1/templates"): (USERS, "template:list"),
    ("GET", "/v1/templates/{ref}"): (USERS, "template:show"),
    ("DELETE", "/v1/templates/{ref}"): (ADMINS, "template:delete"),
    ("PUT", "/v1/template-defaults/{accel_class}"): (ADMINS, "template:set_default"),
    ("POST", "/v1/sandboxes"): (USERS, "sandbox:create"),
    ("GET", "/v1/sandboxes"): (USERS, "sandbox:list"),
    ("GET", "/v1/sandboxes/{sandbox_id}"): (USERS, "sandbox:show"),
    ("DELETE", "/v1/sandboxes/{sandbox_id}"): (USERS, "sandbox:delete"),
    ("POST", "/v1/sandboxes/{sandbox_id}/timeout"): (USERS, "sandbox:set_timeout"),
    ("PUT", "/v1/sandboxes/{sandbox_id}/network"): (USERS, "sandbox:set_network"),
    ("GET", "/v1/sandboxes/{sandbox_id}/events"): (USERS, "sandbox:events"),
    ("GET", "/v1/sandboxes/{sandbox_id}/workload"): (USERS, "sandbox:workload"),
    ("POST", "/v1/sandboxes/{sandbox_id}/connect"): (USERS, "sandbox:connect"),  # hands out a secret: audited
    ("POST", "/v1/tenants"): (ADMINS, "tenant:create"),
    ("GET", "/v1/tenants"): (ADMINS, "tenant:list"),
    ("DELETE", "/v1/tenants/{tenant}"): (ADMINS, "tenant:revoke"),
    ("POST", "/v1/tenants/{tenant}/keys"): (ADMINS, "key:create"),
    ("POST", "/v1/admin-keys"): (ADMINS, "key:create_admin"),
    ("POST", "/v1/keys"): (USERS, "key:create_own"),
    ("GET", "/v1/keys"): (USERS, "key:list"),
    ("DELETE", "/v1/keys/{key_id}"): (USERS, "key:revoke"),
    ("GET", "/v1/audit/seals"): (ADMINS, "audit:seals"),
    # Observability (docs/decisions.md "Who may scrape"): the page is static and public, its data is admins'.
    ("GET", "/metrics"): (ADMINS, "metrics:scrape"),
    ("GET", "/dashboard"): (PUBLIC, "dashboard:page"),
    ("GET", "/v1/dashboard"): (ADMINS, "dashboard:data"),
}
# Mutations audited only when refused: a routine heartbeat every few seconds would drown the log.
AUDIT_REFUSALS_ONLY = {"node:heartbeat"}
# The page runs only its own inline script and talks only to this server; nothing may frame it.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src data:; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}


def route_key(route: BaseRoute, method: str) -> tuple[str, str]:
    return method, str(getattr(route, "path", ""))


def create_spec(body: SandboxBody, header_key: str | None) -> CreateSpec:
    if body.id is not None and SANDBOX_ID_RE.fullmatch(body.id) is None:
        raise CubeError("sandbox.invalid_id", f"invalid sandbox id {body.id!r}: [A-Za-z0-9._-], 1-63 chars", "api")
    if body.gpu is not None and body.accelerators is not None:
        raise CubeError("request.ambiguous_accelerators", "give either gpu (shorthand) or accelerators", "api")
    request: AcceleratorRequest | None = None
    if body.gpu is not None:
        request = parse_shorthand(body.gpu)
    elif body.accelerators is not None:
        request = parse_accelerators(body.accelerators)
    if header_key is not None and not (0 < len(header_key) <= MAX_IDEMPOTENCY_KEY and header_key.isprintable()):
        raise CubeError(
            "request.invalid_idempotency_key",
            f"Idempotency-Key must be 1-{MAX_IDEMPOTENCY_KEY} printable characters, got {len(header_key)}",
            "api",
        )
    key = header_key or body.idempotency_key
    return CreateSpec(
        body.id,
        body.tenant or "default",
        key,
        body.template,
        request or AcceleratorRequest(()),
        body.memory_mib,
        body.vcpus,
        body.timeout_s,
        dict(body.metadata),
        dict(body.env_vars),
        body.workload_token,
        body.network,
    )


class AuditedRequests:
    """CubeMaster's request edge, pure ASGI (no BaseHTTPMiddleware task and memory streams per request): the
    request id is settled before any route runs, so the telemetry line, the audit row and the reply's
    `X-Request-Id` agree; `hook(request, status)` writes the audit row before the status line is sent."""

    def __init__(self, app: Any, hook: Callable[[Request, int], Awaitable[None]]) -> None:
        self.app = app
        self.audited = BeforeReplyMiddleware(app, hook)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = accept_request_id(Headers(scope=scope).get("x-request-id"))
        scope.setdefault("state", {})["request_id"] = rid

        async def with_id(message: Any) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["x-request-id"] = rid
            await send(message)

        await self.audited(scope, receive, with_id)


def create_app(
    master: CubeMaster, maintenance: Maintenance | None = None, audit: AuditLog | Path | None = None
) -> FastAPI:
    """`audit`: the audit log (a path or an open log); None keeps none (unit tests that do not look at it)."""
    metrics = metrics_of(master)
    feed = DashboardFeed(master)
    truth = NodeTruth(master, maintenance.request_reconcile if maintenance is not None else None)
    app = api_app("cubeaccel CubeMaster", body_models=(Heartbeat, TemplateDocument), telemetry=metrics.api)
    auth = master.auth
    log = AuditLog(audit, sealers=[DatabaseSeal(master.store)]) if isinstance(audit, Path) else audit

    async def authorize(request: Request) -> Identity:
        """Every route: who is calling (401 without a valid credential), and may they (403)?"""
        rule = POLICY.get(route_key(request.scope["route"], request.method))
        request.state.action = rule[1] if rule else f"{request.method} {request.url.path}"
        if rule is not None and rule[1] == "device:verb" and request.path_params.get("verb") in DEVICE_VERBS:
            request.state.action = f"device:{request.path_params['verb']}"  # refusals too
        if rule is None:
            raise CubeError("auth.no_policy", "this route has no access rule (refused)", "api")
        roles, _ = rule
        if ANONYMOUS in roles:  # public (health): no credential is looked at
            request.state.identity = ANON
            return ANON
        header = request.headers.get("authorization")
        signed = None
        if header and header.startswith(node_sig.SCHEME + " "):  # a node: the signature covers the body
            target = node_sig.target_of(request.url.path, request.url.query)
            body_sha = request.headers.get(node_sig.BODY_HEADER)
            signed = SignedRequest(request.method, target, await request.body(), body_sha)
        ident = await run_in_threadpool(auth.authenticate, header, signed) or ANON
        request.state.identity = ident
        if ident.role not in roles:
            if ident.role == ANONYMOUS:
                raise CubeError("auth.missing_credential", "this route needs a credential", "api")
            raise forbidden(f"a {ident.role} credential may not call {rule[1]}")
        node_param = request.path_params.get("node")
        if ident.role == NODE and "node" in request.path_params and node_param != ident.node:
            raise CubeError("auth.wrong_node", f"node {ident.node}'s credential cannot act as node {node_param}", "api")
        return ident

    app.router.dependencies.append(Depends(authorize))

    async def audit_request(request: Request, status: int) -> None:
        """Every refusal and every mutation but the noisy ones, written before the status line is sent."""
        action = getattr(request.state, "action", None)
        refused = status >= 400
        mutation = request.method not in ("GET", "HEAD", "OPTIONS")
        audited = refused or (mutation and action not in AUDIT_REFUSALS_ONLY)
        if log is not None and action is not None and audited:
            ident: Identity = getattr(request.state, "identity", ANON)
            await log.append_async(
                action,
                ident.label(),
                "ok" if not refused else "refused",
                status=status,
                reason=getattr(request.state, "error_code", None),
                source=request.client.host if request.client else None,
                request_id=request.state.request_id,
                target=request.url.path,
                tenant=getattr(request.state, "tenant", ident.tenant),
            )

    app.add_middleware(AuditedRequests, hook=audit_request)

    def owned(ident: Identity, sandbox_id: str) -> SandboxRow:
        """A tenant sees only its own sandboxes: another tenant's is 404, as if it did not exist."""
        row = master.get(sandbox_id)
        if ident.role == TENANT and row.tenant != ident.tenant:
            raise CubeError("sandbox.not_found", f"no sandbox {sandbox_id!r}", "api")
        return row

    cfg = master.config

    @app.get("/v1/whoami", response_model=W.WhoAmI)
    def whoami(request: Request) -> W.WhoAmI:
        ident: Identity = request.state.identity
        prefix = auth.sandbox_prefix(ident.tenant) if ident.role == TENANT and ident.tenant else None
        return W.WhoAmI(
            role=ident.role, tenant=ident.tenant, node=ident.node, key_id=ident.key_id, sandbox_id_prefix=prefix
        )

    # ---- identities ---------------------------------------------------------------------------------
    @app.post("/v1/tenants", status_code=201, response_model=W.TenantCreated)
    def create_tenant(body: W.TenantBody, request: Request) -> W.TenantCreated:
        request.state.tenant = body.name
        auth.create_tenant(body.name, Quota.from_json(body.quota.model_dump()))
        kid, key = auth.create_key(TENANT, body.name)
        return W.TenantCreated(name=body.name, key_id=kid, key=key)

    @app.get("/v1/tenants", response_model=W.TenantList)
    def tenants() -> W.TenantList:
        return W.TenantList(tenants=auth.tenants())

    @app.delete("/v1/tenants/{tenant}", response_model=W.Revoked)
    def revoke_tenant(tenant: str, request: Request) -> W.Revoked:
        request.state.tenant = tenant
        auth.revoke_tenant(tenant)
        master.end_revoked({tenant}, SandboxActor.USER)
        return W.Revoked(revoked=tenant)

    @app.post("/v1/tenants/{tenant}/keys", status_code=201, response_model=W.KeyCreated)
    def create_key(tenant: str, request: Request) -> W.KeyCreated:
        request.state.tenant = tenant
        kid, key = auth.create_key(TENANT, tenant)
        return W.KeyCreated(key_id=kid, key=key, tenant=tenant)

    @app.post("/v1/admin-keys", status_code=201, response_model=W.KeyCreated)
    def create_admin_key() -> W.KeyCreated:
        kid, key = auth.create_key(ADMIN)
        return W.KeyCreated(key_id=kid, key=key, tenant=None)

    @app.post("/v1/keys", status_code=201, response_model=W.KeyCreated)
    def create_own_key(request: Request) -> W.KeyCreated:
        """Rotation without downtime: a second key for the caller's own tenant (an admin: an admin key); both
        work until the old one is revoked."""
        ident: Identity = request.state.identity
        request.state.tenant = ident.tenant
        kid, key = auth.create_key(ident.role, ident.tenant)
        return W.KeyCreated(key_id=kid, key=key, tenant=ident.tenant)

    @app.get("/v1/keys", response_model=W.KeyList)
    def keys(request: Request) -> W.KeyList:
        ident: Identity = request.state.identity
        return W.KeyList(keys=auth.keys(ident.tenant if ident.role == TENANT else None))

    @app.delete("/v1/keys/{key_id}", response_model=W.Revoked)
    def revoke_key(key_id: str, request: Request) -> W.Revoked:
        ident: Identity = request.state.identity
        request.state.tenant = ident.tenant
        auth.revoke_key(key_id, ident.tenant if ident.role == TENANT else None)
        return W.Revoked(revoked=key_id)

    @app.get("/v1/audit/seals", response_model=W.AuditSeals)
    def seals() -> W.AuditSeals:
        """Each audit log's sealed head (`cubeaccel audit --verify --master-seal`: a cut-off tail shows)."""
        return W.AuditSeals(seals=[W.AuditSeal.model_validate(s) for s in audit_seals(master.store)])

    @app.post("/v1/nodes/{node}/credential", status_code=201, response_model=W.NodeCredential)
    def enrol(node: str) -> W.NodeCredential:
        return W.NodeCredential(node=node, token=auth.enrol_node(node))

    @app.delete("/v1/nodes/{node}/credential", response_model=W.Revoked)
    def revoke_node(node: str) -> W.Revoked:
        auth.revoke_node(node)
        return W.Revoked(revoked=node)

    @app.get("/metrics", include_in_schema=False)
    def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/dashboard", include_in_schema=False)
    def dashboard_page() -> HTMLResponse:
        """Self-contained (no external assets); the admin key is typed in, kept in the tab's sessionStorage."""
        return HTMLResponse(PAGE, headers=PAGE_HEADERS)

    @app.get("/v1/dashboard", response_model=Dashboard)
    def dashboard() -> dict[str, Any]:
        return feed.snapshot()

    @app.get("/v1/health", response_model=W.Health)
    def health() -> W.Health:
        return W.Health(
            status="ok",
            schema_version=master.store.schema_version,
            db=master.store.dialect,
            errors=maintenance.last_errors if maintenance else [],
        )

    # ---- nodes ------------------------------------------------------------------------------------
    @app.put("/v1/nodes/{node}", response_model=W.HeartbeatAck, openapi_extra=json_body("Heartbeat"))
    def heartbeat(node: str, body: dict[str, Any]) -> W.HeartbeatAck:
        if body.get("node") != node or NODE_ID_RE.fullmatch(node) is None:
            raise CubeError("node.name_mismatch", f"heartbeat for {body.get('node')!r} sent to /v1/nodes/{node}", "api")
        beat = master.store.record_heartbeat(body, time.time(), cfg.staleness_s)  # validated the body
        state, returned = beat.state, beat.returned
        if returned:  # routine heartbeats reach the views within the cache's TTL; new or returning nodes at once
            master.cache.heard(beat)
            if maintenance is not None:
                maintenance.request_reconcile(node)
        try:  # what the node ended; a restart it came back from. The heartbeat is stored either way: a failure
            # here must not turn every later heartbeat into a 500 (the node would go stale); the next one retries
            truth.heard(node, NodeNews.model_validate(body))
        except Exception:
            logging.getLogger("cubeaccel.master").exception("node truth from %s's heartbeat not applied", node)
        return W.HeartbeatAck(node=node, state=NodeState(state))

    def node_views() -> list[W.NodeSummary]:
        now = time.time()
        views = sorted(master.cache.views(fresh=True), key=lambda v: v.name)
        return [v.summary(now, cfg.staleness_s, W.NodeSummary) for v in views]

    @app.get("/v1/nodes", response_model=W.NodeList)
    def nodes() -> W.NodeList:
        return W.NodeList(nodes=node_views())

    @app.get("/v1/nodes/{node}", response_model=W.NodeReply)
    def node(node: str) -> W.NodeReply:
        view = next((v for v in master.cache.views(fresh=True) if v.name == node), None)
        if view is None:
            raise CubeError("node.not_found", f"no node {node!r}", "api")
        return view.summary(time.time(), cfg.staleness_s, W.NodeReply)

    @app.post("/v1/nodes/{node}/{verb}", response_model=W.NodeVerbReply)
    def node_verb(node: str, verb: str, request: Request, body: OperatorBody | None = None) -> W.NodeVerbReply:
        if verb == "reconcile":
            return W.NodeVerbReply.model_validate(reconcile_node(master, node))
        if verb not in ("drain", "undrain"):
            raise CubeError("api.unknown_verb", f"unknown node verb {verb!r}; known: drain, undrain, reconcile", "api")
        state = master.store.node_event(node, NodeEvent(verb))
        master.cache.invalidate()
        ident: Identity = request.state.identity  # the authenticated identity, not whatever `who` says
        said = {"node": node, "state": state.value, "who": ident.label(), "warm": warm_verb(node, verb)}
        return W.NodeVerbReply.model_validate(said)

    def warm_verb(node: str, verb: str) -> WarmDrainReply | WarmVerbFailure:
        """A drain removes the node's warm sandboxes first (and stops their refill); undrain resumes it. The
        node's state changed either way: an unreachable Cubelet is reported, not an error of the drain."""
        try:
            reply: WarmDrainReply = forwarded(node, lambda c: c.warm_drain() if verb == "drain" else c.warm_undrain())
            return reply
        except CubeError as e:
            return WarmVerbFailure(error=e.code, message=e.message)
        except ValidationError as e:  # a malformed answer: as the warm claim reads one, the Cubelet's failure
            return WarmVerbFailure(error="cubelet.unreachable", message=f"malformed reply: {e}"[:300])

    def cubelet_of(node: str) -> CubeletClient:
        view = next((v for v in master.cache.views(fresh=True) if v.name == node), None)
        if view is None:
            raise CubeError("node.not_found", f"no node {node!r}", "api")
        return master.client(view.cubelet_url)

    def forwarded(node: str, call: Any) -> Any:
        try:
            return call(cubelet_of(node))
        except httpx.HTTPError as e:
            raise CubeError(
                "cubelet.unreachable", f"node {node}'s Cubelet: {type(e).__name__}", "api", {"node": node}
            ) from e

    @app.get("/v1/nodes/{node}/devices", response_model=W.NodeDevices)
    def node_devices(node: str) -> W.NodeDevices:
        return W.NodeDevices(node=node, devices=forwarded(node, lambda c: c.devices()))

    @app.post("/v1/nodes/{node}/devices/{device_id}/{verb}", response_model=W.NodeDevice)
    def device_verb(node: str, device_id: str, verb: str, body: W.DeviceVerbBody, request: Request) -> W.NodeDevice:
        """quarantine | recover | disable | enable on one device of `node`, done by that node's Cubelet (its TCP
        API, with the node's token); the Cubelet's events and both audit logs name the admin's key."""
        if verb not in DEVICE_VERBS:
            raise CubeError("api.unknown_verb", f"unknown device verb {verb!r}; known: {sorted(DEVICE_VERBS)}", "api")
        ident: Identity = request.state.identity
        rid = request.state.request_id
        dev = forwarded(
            node,
            lambda c: c.verb(
                device_id, verb, ident.label(), body.reason, request_id=rid, restore_driver=body.restore_driver
            ),
        )
        return W.NodeDevice(node=node, device=dev)

    @app.get("/v1/capacity", response_model=W.Capacity)
    def capacity() -> W.Capacity:
        ns = node_views()
        by_model: Counter[str] = Counter()
        free_model: Counter[str] = Counter()
        warm: Counter[str] = Counter()  # claimable warm sandboxes by template: capacity for matching creates
        for n in ns:
            for g in n.groups:
                name = f"{g.accel_class}/{g.labels.get('model', '?')}"
                by_model[name] += g.total
                free_model[name] += g.allocatable if n.schedulable else 0
            for p in n.warm_pools if n.schedulable else ():
                warm[p.template or p.key] += p.claimable
        return W.Capacity(
            nodes=len(ns),
            schedulable_nodes=sum(n.schedulable for n in ns),
            by_state=dict(Counter(str(n.state) for n in ns)),
            total=sum(by_model.values()),
            allocatable=sum(free_model.values()),
            models={k: W.ModelCapacity(total=by_model[k], allocatable=free_model[k]) for k in sorted(by_model)},
            warm=dict(warm),
        )

    # ---- templates --------------------------------------------------------------------------------
    @app.post(
        "/v1/templates",
        status_code=201,
        response_model=W.TemplateRegistered,
        openapi_extra=json_body("TemplateDocument"),
    )
    def register_template(document: dict[str, Any], default: bool = False) -> W.TemplateRegistered:
        return master.registry.register(document, default)

    @app.get("/v1/templates", response_model=W.TemplateList)
    def templates() -> W.TemplateList:
        return W.TemplateList(templates=master.registry.list(), defaults=master.store.defaults())

    @app.get("/v1/templates/{ref}", response_model=W.TemplateShown)
    def template(ref: str) -> W.TemplateShown:
        return master.registry.show(ref)

    @app.delete("/v1/templates/{ref}", response_model=W.TemplateDeleted)
    def delete_template(ref: str) -> W.TemplateDeleted:
        return master.registry.delete(ref)

    @app.put("/v1/template-defaults/{accel_class}", response_model=W.DefaultSet)
    def set_default(accel_class: str, body: W.DefaultBody) -> W.DefaultSet:
        master.registry.set_default(accel_class, body.template)
        return W.DefaultSet(accel_class=accel_class, template=body.template)

    # ---- sandboxes --------------------------------------------------------------------------------
    async def settle(sandbox_id: str, wait_s: float) -> SandboxRow:
        """The sandbox once it is running (guest validated, so its workload service is up: the shim waits for
        it before validation), failed (code and layer in `error`) or gone, or as it is when `wait_s` ends. Async
        so that a thousand waiting callers hold no worker thread (heartbeats must still get one)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            row = await run_in_threadpool(master.get, sandbox_id)
            if row.state in SETTLED_STATES or loop.time() >= deadline:
                return row
            await asyncio.sleep(WAIT_POLL_S)

    WaitQuery = Query(0.0, ge=0.0, le=MAX_WAIT_S, description="seconds to wait until running, failed or gone")

    @app.post("/v1/sandboxes", status_code=201, response_model=W.SandboxReply)
    async def create(
        body: SandboxBody, request: Request, response: Response, wait: float = WaitQuery
    ) -> W.SandboxReply:
        reply = await run_in_threadpool(create_now, body, request, response)
        if wait > 0 and reply.state not in SETTLED_STATES:
            row = await settle(reply.id, wait)
            reply = sandbox_record(row, W.SandboxReply, access_token=reply.access_token)
        return reply

    def create_now(body: SandboxBody, request: Request, response: Response) -> W.SandboxReply:
        ident: Identity = request.state.identity
        if ident.role == TENANT:
            if body.tenant not in (None, ident.tenant):
                raise forbidden(f"tenant {ident.tenant}'s key cannot create for tenant {body.tenant}")
            body = body.model_copy(update={"tenant": ident.tenant})
            prefix = auth.sandbox_prefix(ident.tenant or "")
            if body.id is not None and not body.id.startswith(prefix):
                # Whether the id is free, another tenant's or deleted, the answer is this one (issue 30 #1).
                raise CubeError(
                    "sandbox.id_outside_namespace",
                    f"a sandbox id tenant {ident.tenant} chooses starts with {prefix!r} (GET /v1/whoami:"
                    " sandbox_id_prefix); leave `id` out to have one made",
                    "api",
                    {"sandbox_id_prefix": prefix},
                )
        elif body.tenant is None:
            body = body.model_copy(update={"tenant": DEFAULT_TENANT})
        request.state.tenant = body.tenant
        spec = create_spec(body, request.headers.get("idempotency-key"))
        if not spec.request.choices:
            if spec.template is None:
                raise CubeError("request.no_accelerator", "give gpu (e.g. 'H100:1'), accelerators or a template", "api")
            cls = master.registry.contract(spec.template).accel_class
            spec = dataclasses.replace(spec, request=for_template(cls))
        t0 = time.perf_counter()
        try:
            row, created = master.create(spec)
        except CubeError as e:
            metrics.created("refused", time.perf_counter() - t0, e.code)
            raise
        metrics.created("created" if created else "replayed", time.perf_counter() - t0)
        if not created:
            response.status_code = 200
        token = master.issued_tokens.pop(str(row.id), None)
        return sandbox_record(row, W.SandboxReply, access_token=token)

    @app.get("/v1/sandboxes", response_model=W.SandboxList)
    def sandboxes(request: Request, state: str | None = None, node: str | None = None) -> W.SandboxList:
        ident: Identity = request.state.identity
        if state == WARM_STATE:  # the nodes' warm sandboxes (no tenant's until claimed): an admin's view
            views = [v for v in master.cache.views() if node in (None, v.name)]
            return W.SandboxList(sandboxes=[] if ident.role == TENANT else list(warm_rows(views)))
        if state is not None and state not in SANDBOX_STATES:
            raise CubeError("api.invalid_state", f"unknown state {state!r}; known: {list(SANDBOX_STATES)}", "api")
        rows = master.store.sandboxes(states=(SandboxState(state),) if state else None, node=node)
        if ident.role == TENANT:
            rows = [r for r in rows if r.tenant == ident.tenant]
        silent = silent_nodes(master)
        return W.SandboxList(sandboxes=[sandbox_record(r, W.Sandbox, silent) for r in rows])

    @app.get("/v1/sandboxes/{sandbox_id}", response_model=W.SandboxReply)
    async def sandbox(sandbox_id: str, request: Request, wait: float = WaitQuery) -> W.SandboxReply:
        row = await run_in_threadpool(owned, request.state.identity, sandbox_id)
        if wait > 0 and row.state not in SETTLED_STATES:
            row = await settle(sandbox_id, wait)
        return sandbox_record(row, W.SandboxReply, silent_nodes(master))

    @app.get("/v1/sandboxes/{sandbox_id}/events", response_model=W.SandboxEvents)
    def sandbox_events(sandbox_id: str, request: Request) -> W.SandboxEvents:
        """The start phases the sandbox's node recorded, fetched with the node token (a user has none)."""
        row = owned(request.state.identity, sandbox_id)
        phases, answered = master.start_phases(row)
        return W.SandboxEvents(sandbox_id=sandbox_id, state=row.state, phases=phases, node_answered=answered)

    def workload_of(row: SandboxRow) -> W.WorkloadEndpoint:
        url = master.node_url(row.node) if row.state == SandboxState.RUNNING.value else None
        if url is None or row.node is None:
            raise CubeError(
                "workload.not_running",
                f"sandbox {row.id} is {row.state}, not running",
                "api",
                {"state": row.state},
            )
        base = f"{url.rstrip('/')}/v1/sandboxes/{quote(row.id, safe='')}/workload"
        return W.WorkloadEndpoint(sandbox_id=row.id, node=row.node, url=base)

    @app.get("/v1/sandboxes/{sandbox_id}/workload", response_model=W.WorkloadEndpoint)
    def sandbox_workload(sandbox_id: str, request: Request) -> W.WorkloadEndpoint:
        """The node's workload proxy for the caller's own running sandbox: a tenant's way to exec and copy, which
        needs no node route (those are admins')."""
        return workload_of(owned(request.state.identity, sandbox_id))

    @app.post("/v1/sandboxes/{sandbox_id}/connect", response_model=W.WorkloadConnection)
    def sandbox_connect(sandbox_id: str, request: Request) -> W.WorkloadConnection:
        """The caller's own running sandbox's workload endpoint and access token: the owner's key is enough to
        obtain it, as E2B's connect gives it to the owner (the CLI's exec and cp need no `--token`). Only for a
        token CubeMaster derived: one the creator chose (the E2B front door's) is the creator's to give."""
        row = owned(request.state.identity, sandbox_id)
        request.state.tenant = row.tenant
        endpoint = workload_of(row)
        if row.token_salt is None:
            raise CubeError(
                "workload.token_unavailable",
                f"sandbox {sandbox_id}'s access token was chosen by its creator (the E2B front door gives it on"
                " connect) or predates tokens CubeMaster can give again: pass --token",
                "api",
            )
        token = auth.workload_token(row.id, row.token_salt)
        return W.WorkloadConnection(**endpoint.model_dump(exclude={"v"}), access_token=token)

    @app.post("/v1/sandboxes/{sandbox_id}/timeout", response_model=W.SandboxReply)
    def set_timeout(sandbox_id: str, body: W.TimeoutBody, request: Request) -> W.SandboxReply:
        request.state.tenant = owned(request.state.identity, sandbox_id).tenant
        return sandbox_record(master.set_timeout(sandbox_id, body.timeout_s), W.SandboxReply)

    @app.put("/v1/sandboxes/{sandbox_id}/network", response_model=W.SandboxReply)
    def set_network(sandbox_id: str, body: W.NetworkBody, request: Request) -> W.SandboxReply:
        """A running sandbox's egress policy, changed on its node, then recorded (master/sandbox_network.py)."""
        request.state.tenant = owned(request.state.identity, sandbox_id).tenant
        return sandbox_record(sandbox_network.set_network(master, sandbox_id, body.network), W.SandboxReply)

    @app.delete("/v1/sandboxes/{sandbox_id}", status_code=202, response_model=W.SandboxReply)
    def delete(sandbox_id: str, request: Request) -> W.SandboxReply:
        request.state.tenant = owned(request.state.identity, sandbox_id).tenant
        return sandbox_record(master.delete(sandbox_id), W.SandboxReply)

    @app.put("/v1/nodes/{node}/sandboxes/{sandbox_id}/status", response_model=W.StatusReply)
    def sandbox_status(node: str, sandbox_id: str, body: W.StatusBody) -> W.StatusReply:
        """Cubelet's push: the sandbox is ready (guest validated), or failed with code and layer."""
        if (body.phase == "failed") != (body.error is not None):
            raise CubeError("api.invalid_request", "a failed status carries an error; a running one does not", "api")
        error = None if body.error is None else sandbox_error(body.error)
        return W.StatusReply(state=master.node_status(node, sandbox_id, body.phase, error))

    return app
