"""The Cubelet's request audit: device assignment (reserve/start, a warm claim), release, operator verbs,
reconcile, warm pool changes, and every refusal, each written before the reply's status line is sent."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from cubeaccel.host.service.audit import AuditLog
from cubeaccel.transport.http_server import PEER_KEY

# Local mutations audited only when refused: a shim reports many times per sandbox; the journal keeps them all.
AUDIT_REFUSALS_ONLY = {"/v1/shim-reports"}

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


# One per component, each its own listener's words; the other is master/api/access.py's RequestAudit.
class RequestAudit:
    """A `BeforeReplyMiddleware` hook. `who`: the listener's caller as this node knows it (the local socket, or
    CubeMaster by the node token); `node`: this node's name, on every row."""

    def __init__(self, audit: AuditLog, who: str, node: str) -> None:
        self._audit = audit
        self._who = who
        self._node = node

    async def __call__(self, request: Request, status: int) -> None:
        path, refused = request.url.path, status >= 400
        mutation = request.method not in ("GET", "HEAD", "OPTIONS") and path not in AUDIT_REFUSALS_ONLY
        if refused or mutation:
            creds = request.scope.get(PEER_KEY)  # the unix socket's caller, as the kernel says
            peer = {} if creds is None else {"peer_pid": creds[0], "peer_uid": creds[1]}
            await self._audit.append_async(
                _action(request),
                self._who if status != 401 else "anonymous",
                "refused" if refused else "ok",
                status=status,
                reason=getattr(request.state, "error_code", None),
                source=request.client.host if request.client else None,
                request_id=getattr(request.state, "request_id", None) or request.headers.get("x-request-id"),
                target=path,
                node=self._node,
                **peer,
                **getattr(request.state, "audit_fields", None) or _body_fields(request),
            )


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
