"""HTTP client for the CubeMaster API, with a sync face (CLI, `cubeaccel up`, tests) and an async one (the E2B
front door) over one request core: the same credentials, `?wait=` timeouts and reply parsing. Errors come back as
`CubeError`."""

from __future__ import annotations

from typing import Any

import httpx

from cubeaccel.wire.http_reply import reply_body
from cubeaccel.wire.master_api import WorkloadEndpoint
from cubeaccel.wire.node_sig import NodeAuth
from cubeaccel.wire.telemetry import add_request_id


def _credentials(key: str | None) -> tuple[dict[str, str] | None, NodeAuth | None]:
    """`key`: an API key (tenant or admin), sent as a bearer credential, or a node token (`cbn:…`), which signs
    each request instead (wire/node_sig.py)."""
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


class MasterClient:
    def __init__(self, url: str, timeout: float = 60.0, key: str | None = None) -> None:
        self.url = url.rstrip("/")
        headers, auth = _credentials(key)
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
        params, timeout = _call_options(self._http.timeout.connect, params, wait_s)
        return reply_body(self._http.request(method, path, json=json, params=params, headers=headers, timeout=timeout))

    def health(self) -> dict[str, Any]:
        return dict(self.request("GET", "/v1/health"))

    def nodes(self) -> list[dict[str, Any]]:
        return list(self.request("GET", "/v1/nodes")["nodes"])

    def capacity(self) -> dict[str, Any]:
        return dict(self.request("GET", "/v1/capacity"))

    def register_template(self, document: dict[str, Any], default: bool = False) -> dict[str, Any]:
        return dict(self.request("POST", "/v1/templates", document, params={"default": str(default).lower()}))

    def create(
        self, body: dict[str, Any], idempotency_key: str | None = None, wait_s: float | None = None
    ) -> dict[str, Any]:
        """`wait_s`: CubeMaster answers once the sandbox is running (workload service up), failed or gone."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        return dict(self.request("POST", "/v1/sandboxes", body, headers=headers, wait_s=wait_s))

    def sandbox(self, sandbox_id: str, wait_s: float | None = None) -> dict[str, Any]:
        return dict(self.request("GET", f"/v1/sandboxes/{sandbox_id}", wait_s=wait_s))

    def sandbox_events(self, sandbox_id: str) -> dict[str, Any]:
        """The start phases the sandbox's node recorded, through CubeMaster."""
        return dict(self.request("GET", f"/v1/sandboxes/{sandbox_id}/events"))

    def workload_endpoint(self, sandbox_id: str) -> WorkloadEndpoint:
        """Where the caller's own running sandbox's workload is reached (a tenant key is enough)."""
        return WorkloadEndpoint.model_validate(self.request("GET", f"/v1/sandboxes/{sandbox_id}/workload"))

    def sandboxes(self, state: str | None = None) -> list[dict[str, Any]]:
        params = {"state": state} if state else None
        return list(self.request("GET", "/v1/sandboxes", params=params)["sandboxes"])

    def set_timeout(self, sandbox_id: str, timeout_s: float) -> dict[str, Any]:
        return dict(self.request("POST", f"/v1/sandboxes/{sandbox_id}/timeout", {"timeout_s": timeout_s}))

    def delete(self, sandbox_id: str) -> dict[str, Any]:
        return dict(self.request("DELETE", f"/v1/sandboxes/{sandbox_id}"))

    def node_verb(self, node: str, verb: str, who: str = "operator", reason: str | None = None) -> dict[str, Any]:
        body = {"who": who} if reason is None else {"who": who, "reason": reason}
        return dict(self.request("POST", f"/v1/nodes/{node}/{verb}", body))

    def close(self) -> None:
        self._http.close()


class AsyncMasterClient:
    """The async face: the same calls as `MasterClient.request`, and a key per call where one client serves many
    callers."""

    def __init__(self, url: str, timeout: float = 60.0, key: str | None = None) -> None:
        self.url = url.rstrip("/")
        headers, auth = _credentials(key)
        self._http = httpx.AsyncClient(
            base_url=self.url, timeout=timeout, headers=headers, auth=auth, event_hooks={"request": [_add_request_id]}
        )

    async def request(
        self,
        method: str,
        path: str,
        json: Any = None,
        params: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        wait_s: float | None = None,
        key: str | None = None,
    ) -> Any:
        params, timeout = _call_options(self._http.timeout.connect, params, wait_s)
        r = await self._http.request(
            method, path, json=json, params=params, headers=_bearer(key, headers), timeout=timeout
        )
        return reply_body(r)

    async def aclose(self) -> None:
        await self._http.aclose()
