"""HTTP client for the CubeMaster API, with a sync face (CLI, `cubeaccel up`, tests) and an async one (the E2B
front door) over one request core: the same credentials, `?wait=` timeouts and reply parsing. Each endpoint is a
`Call` (built by `Calls`) that names the reply model it parses into, so both faces return the same typed values.
Errors come back as `CubeError`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel

from cubeaccel.transport.http_reply import reply_body
from cubeaccel.transport.node_sig import NodeAuth
from cubeaccel.transport.telemetry import add_request_id
from cubeaccel.wire import master_api as W
from cubeaccel.wire.heartbeat import Heartbeat


def _credentials(key: str | None) -> tuple[dict[str, str] | None, NodeAuth | None]:
    """`key`: an API key (tenant or admin), sent as a bearer credential, or a node token (`cbn:…`), which signs
    each request instead (transport/node_sig.py)."""
    if key and key.startswith("cbn:"):
        return None, NodeAuth(key)
    return ({"Authorization": f"Bearer {key}"} if key else None), None


def _call_options(
    connect_s: float | None, params: dict[str, Any] | None, wait_s: float | None
) -> tuple[dict[str, Any] | None, Any]:
    """`wait_s`: the server holds the request up to that long (`?wait=`): the read timeout covers it."""
    if not wait_s:
        return params, httpx.USE_CLIENT_DEFAULT
    return {**(params or {}), "wait": wait_s}, httpx.Timeout(connect_s, read=wait_s + 30.0, write=30.0, pool=30.0)


def _bearer(key: str | None, headers: dict[str, str] | None) -> dict[str, str] | None:
    """A per-call API key (the front door sends each caller's own) on top of the call's headers."""
    return headers if key is None else {**(headers or {}), "Authorization": f"Bearer {key}"}


async def _add_request_id(request: httpx.Request) -> None:
    add_request_id(request)


ReplyT = TypeVar("ReplyT", bound=BaseModel)


@dataclass(frozen=True)
class Call(Generic[ReplyT]):
    """One CubeMaster request and the model its reply is parsed into."""

    method: str
    path: str
    reply: type[ReplyT]
    json: Any = None
    params: dict[str, Any] | None = None
    headers: dict[str, str] | None = None
    wait_s: float | None = None  # the server holds the request up to that long (`?wait=`)


def _q(part: str) -> str:
    return quote(part, safe="")


class Calls:
    """CubeMaster's endpoints as `Call`s (docs/master.md), for either face of the client."""

    @staticmethod
    def health() -> Call[W.Health]:
        return Call("GET", "/v1/health", W.Health)

    @staticmethod
    def whoami() -> Call[W.WhoAmI]:
        return Call("GET", "/v1/whoami", W.WhoAmI)

    @staticmethod
    def nodes() -> Call[W.NodeList]:
        return Call("GET", "/v1/nodes", W.NodeList)

    @staticmethod
    def node(node: str) -> Call[W.NodeReply]:
        return Call("GET", f"/v1/nodes/{_q(node)}", W.NodeReply)

    @staticmethod
    def node_verb(node: str, verb: str, who: str = "operator", reason: str | None = None) -> Call[W.NodeVerbReply]:
        body = {"who": who} if reason is None else {"who": who, "reason": reason}
        return Call("POST", f"/v1/nodes/{_q(node)}/{_q(verb)}", W.NodeVerbReply, body)

    @staticmethod
    def node_devices(node: str) -> Call[W.NodeDevices]:
        return Call("GET", f"/v1/nodes/{_q(node)}/devices", W.NodeDevices)

    @staticmethod
    def capacity() -> Call[W.Capacity]:
        return Call("GET", "/v1/capacity", W.Capacity)

    @staticmethod
    def register_template(document: object, default: bool = False) -> Call[W.TemplateRegistered]:
        params = {"default": str(default).lower()}
        return Call("POST", "/v1/templates", W.TemplateRegistered, document, params=params)

    @staticmethod
    def templates() -> Call[W.TemplateList]:
        return Call("GET", "/v1/templates", W.TemplateList)

    @staticmethod
    def template(ref: str) -> Call[W.TemplateShown]:
        return Call("GET", f"/v1/templates/{_q(ref)}", W.TemplateShown)

    @staticmethod
    def delete_template(ref: str) -> Call[W.TemplateDeleted]:
        return Call("DELETE", f"/v1/templates/{_q(ref)}", W.TemplateDeleted)

    @staticmethod
    def create(
        body: W.SandboxBody | dict[str, Any], idempotency_key: str | None = None, wait_s: float | None = None
    ) -> Call[W.SandboxReply]:
        """`wait_s`: CubeMaster answers once the sandbox is running (workload service up), failed or gone. A
        `SandboxBody` is sent with the fields it was given, as the dict it stands for would be."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        if isinstance(body, W.SandboxBody):
            body = body.model_dump(mode="json", exclude_unset=True)
        return Call("POST", "/v1/sandboxes", W.SandboxReply, body, headers=headers, wait_s=wait_s)

    @staticmethod
    def sandbox(sandbox_id: str, wait_s: float | None = None) -> Call[W.SandboxReply]:
        return Call("GET", f"/v1/sandboxes/{_q(sandbox_id)}", W.SandboxReply, wait_s=wait_s)

    @staticmethod
    def sandboxes(state: str | None = None) -> Call[W.SandboxList]:
        return Call("GET", "/v1/sandboxes", W.SandboxList, params={"state": state} if state else None)

    @staticmethod
    def sandbox_events(sandbox_id: str) -> Call[W.SandboxEvents]:
        """The start phases the sandbox's node recorded, through CubeMaster."""
        return Call("GET", f"/v1/sandboxes/{_q(sandbox_id)}/events", W.SandboxEvents)

    @staticmethod
    def workload_endpoint(sandbox_id: str) -> Call[W.WorkloadEndpoint]:
        """Where the caller's own running sandbox's workload is reached (a tenant key is enough)."""
        return Call("GET", f"/v1/sandboxes/{_q(sandbox_id)}/workload", W.WorkloadEndpoint)

    @staticmethod
    def connect(sandbox_id: str) -> Call[W.WorkloadConnection]:
        """The caller's own running sandbox's workload endpoint with its access token (the owner's key is enough)."""
        return Call("POST", f"/v1/sandboxes/{_q(sandbox_id)}/connect", W.WorkloadConnection)

    @staticmethod
    def set_timeout(sandbox_id: str, timeout_s: float) -> Call[W.SandboxReply]:
        return Call("POST", f"/v1/sandboxes/{_q(sandbox_id)}/timeout", W.SandboxReply, {"timeout_s": timeout_s})

    @staticmethod
    def set_network(sandbox_id: str, network: dict[str, Any]) -> Call[W.SandboxReply]:
        return Call("PUT", f"/v1/sandboxes/{_q(sandbox_id)}/network", W.SandboxReply, {"network": network})

    @staticmethod
    def delete(sandbox_id: str) -> Call[W.SandboxReply]:
        return Call("DELETE", f"/v1/sandboxes/{_q(sandbox_id)}", W.SandboxReply)

    @staticmethod
    def create_tenant(name: str, quota: dict[str, Any]) -> Call[W.TenantCreated]:
        return Call("POST", "/v1/tenants", W.TenantCreated, {"name": name, "quota": quota})

    @staticmethod
    def tenants() -> Call[W.TenantList]:
        return Call("GET", "/v1/tenants", W.TenantList)

    @staticmethod
    def revoke_tenant(name: str) -> Call[W.Revoked]:
        return Call("DELETE", f"/v1/tenants/{_q(name)}", W.Revoked)

    @staticmethod
    def create_key(tenant: str | None = None, admin: bool = False) -> Call[W.KeyCreated]:
        """A key for `tenant`; else an admin key (`admin`), else one for the caller's own tenant."""
        path = f"/v1/tenants/{_q(tenant)}/keys" if tenant else "/v1/admin-keys" if admin else "/v1/keys"
        return Call("POST", path, W.KeyCreated)

    @staticmethod
    def keys() -> Call[W.KeyList]:
        return Call("GET", "/v1/keys", W.KeyList)

    @staticmethod
    def revoke_key(key_id: str) -> Call[W.Revoked]:
        return Call("DELETE", f"/v1/keys/{_q(key_id)}", W.Revoked)

    @staticmethod
    def enrol(node: str) -> Call[W.NodeCredential]:
        return Call("POST", f"/v1/nodes/{_q(node)}/credential", W.NodeCredential)

    @staticmethod
    def revoke_node(node: str) -> Call[W.Revoked]:
        return Call("DELETE", f"/v1/nodes/{_q(node)}/credential", W.Revoked)

    @staticmethod
    def seals() -> Call[W.AuditSeals]:
        return Call("GET", "/v1/audit/seals", W.AuditSeals)

    # ---- a node's own calls (signed with its node token) ----------------------------------------------------------
    @staticmethod
    def heartbeat(node: str, body: Heartbeat) -> Call[W.HeartbeatAck]:
        """The node's capacity summary; CubeMaster answers with the state it now holds the node in."""
        return Call("PUT", f"/v1/nodes/{_q(node)}", W.HeartbeatAck, body.to_json())

    @staticmethod
    def sandbox_status(node: str, sandbox_id: str, status: W.StatusBody) -> Call[W.StatusReply]:
        """A sandbox on the node became ready, or failed (code and layer); CubeMaster answers with its state."""
        path = f"/v1/nodes/{_q(node)}/sandboxes/{_q(sandbox_id)}/status"
        # absent, not null, when unset: a CubeMaster that predates a field still takes the push
        return Call("PUT", path, W.StatusReply, status.model_dump(mode="json", exclude_none=True))


class MasterClient:
    def __init__(
        self,
        url: str,
        timeout: float = 60.0,
        key: str | None = None,
        node_token: str | Callable[[], str | None] | None = None,
    ) -> None:
        """`node_token`: where a node's client reads its current token (it may be renewed while the client
        lives); each request is signed with it, as `key` would for a fixed `cbn:` token."""
        self.url = url.rstrip("/")
        headers, auth = _credentials(key)
        if node_token:
            auth = NodeAuth(node_token)
        self._http = httpx.Client(
            base_url=self.url, timeout=timeout, headers=headers, auth=auth, event_hooks={"request": [add_request_id]}
        )

    def request(
        self,
        method: str,
        path: str,
        json: Any = None,
        params: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        wait_s: float | None = None,
    ) -> Any:
        """The reply's JSON as it came (for a route no `Call` names)."""
        params, timeout = _call_options(self._http.timeout.connect, params, wait_s)
        return reply_body(self._http.request(method, path, json=json, params=params, headers=headers, timeout=timeout))

    def call(self, c: Call[ReplyT]) -> ReplyT:
        return c.reply.model_validate(self.request(c.method, c.path, c.json, c.params, c.headers, c.wait_s))

    def health(self) -> W.Health:
        return self.call(Calls.health())

    def nodes(self) -> list[W.NodeSummary]:
        return self.call(Calls.nodes()).nodes

    def capacity(self) -> W.Capacity:
        return self.call(Calls.capacity())

    def register_template(self, document: object, default: bool = False) -> W.TemplateRegistered:
        return self.call(Calls.register_template(document, default))

    def create(
        self, body: dict[str, Any], idempotency_key: str | None = None, wait_s: float | None = None
    ) -> W.SandboxReply:
        return self.call(Calls.create(body, idempotency_key, wait_s))

    def sandbox(self, sandbox_id: str, wait_s: float | None = None) -> W.SandboxReply:
        return self.call(Calls.sandbox(sandbox_id, wait_s))

    def sandbox_events(self, sandbox_id: str) -> W.SandboxEvents:
        return self.call(Calls.sandbox_events(sandbox_id))

    def workload_endpoint(self, sandbox_id: str) -> W.WorkloadEndpoint:
        return self.call(Calls.workload_endpoint(sandbox_id))

    def connect(self, sandbox_id: str) -> W.WorkloadConnection:
        return self.call(Calls.connect(sandbox_id))

    def sandboxes(self, state: str | None = None) -> list[W.Sandbox | W.WarmSandbox]:
        return self.call(Calls.sandboxes(state)).sandboxes

    def set_timeout(self, sandbox_id: str, timeout_s: float) -> W.SandboxReply:
        return self.call(Calls.set_timeout(sandbox_id, timeout_s))

    def set_network(self, sandbox_id: str, network: dict[str, Any]) -> W.SandboxReply:
        return self.call(Calls.set_network(sandbox_id, network))

    def delete(self, sandbox_id: str) -> W.SandboxReply:
        return self.call(Calls.delete(sandbox_id))

    def node_verb(self, node: str, verb: str, who: str = "operator", reason: str | None = None) -> W.NodeVerbReply:
        return self.call(Calls.node_verb(node, verb, who, reason))

    def heartbeat(self, node: str, body: Heartbeat) -> W.HeartbeatAck:
        return self.call(Calls.heartbeat(node, body))

    def sandbox_status(self, node: str, sandbox_id: str, status: W.StatusBody) -> W.StatusReply:
        return self.call(Calls.sandbox_status(node, sandbox_id, status))

    def close(self) -> None:
        self._http.close()


class AsyncMasterClient:
    """The async face: the same `Call`s as `MasterClient.call`, and a key per call where one client serves many
    callers."""

    def __init__(self, url: str, timeout: float = 60.0, key: str | None = None) -> None:
        self.url = url.rstrip("/")
        headers, auth = _credentials(key)
        self._http = httpx.AsyncClient(
            base_url=self.url, timeout=timeout, headers=headers, auth=auth, event_hooks={"request": [_add_request_id]}
        )

    async def call(self, c: Call[ReplyT], key: str | None = None) -> ReplyT:
        params, timeout = _call_options(self._http.timeout.connect, c.params, c.wait_s)
        r = await self._http.request(
            c.method, c.path, json=c.json, params=params, headers=_bearer(key, c.headers), timeout=timeout
        )
        return c.reply.model_validate(reply_body(r))

    async def aclose(self) -> None:
        await self._http.aclose()
