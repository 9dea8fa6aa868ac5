"""Who may call each CubeMaster route (`POLICY`, checked by `authorize` before any route runs) and the audit row
each refusal and mutation leaves (`RequestAudit`, written by `AuditedRequests` before the status line is sent).

Errors have the Cubelet's format: `{"error": {"code", "layer", "message", "details"}}` with a status.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers, MutableHeaders
from starlette.routing import BaseRoute

from cubeaccel.host.service.audit import AuditLog
from cubeaccel.master.api.deps import AuthDep
from cubeaccel.master.auth import ADMIN, ANON, ANONYMOUS, NODE, TENANT, Identity, SignedRequest, forbidden
from cubeaccel.protocol.errors import CubeError
from cubeaccel.transport import node_sig
from cubeaccel.transport.api_edges import BeforeReplyMiddleware
from cubeaccel.transport.telemetry import accept_request_id

DEVICE_VERBS = frozenset({"quarantine", "recover", "disable", "enable"})

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


def route_key(route: BaseRoute, method: str) -> tuple[str, str]:
    return method, str(getattr(route, "path", ""))


async def authorize(request: Request, auth: AuthDep) -> Identity:
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


# One per component, each its own listener's words; the other is cubelet/api/audit.py's RequestAudit.
class RequestAudit:
    """Every refusal and every mutation but the noisy ones, written before the status line is sent. `log` None
    keeps none (unit tests that do not look at it)."""

    def __init__(self, log: AuditLog | None) -> None:
        self.log = log

    async def __call__(self, request: Request, status: int) -> None:
        action = getattr(request.state, "action", None)
        refused = status >= 400
        mutation = request.method not in ("GET", "HEAD", "OPTIONS")
        audited = refused or (mutation and action not in AUDIT_REFUSALS_ONLY)
        if self.log is not None and action is not None and audited:
            ident: Identity = getattr(request.state, "identity", ANON)
            await self.log.append_async(
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
