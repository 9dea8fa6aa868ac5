"""HTTP client for the CubeMaster API (CLI, `cubeaccel up`, tests). Errors come back as `CubeError`."""

from __future__ import annotations

from typing import Any

import httpx

from cubeaccel.wire.http_reply import reply_body
from cubeaccel.wire.master_api import WorkloadEndpoint
from cubeaccel.wire.node_sig import NodeAuth
from cubeaccel.wire.telemetry import add_request_id


class MasterClient:
    def __init__(self, url: str, timeout: float = 60.0, key: str | None = None) -> None:
        """`key`: an API key (tenant or admin), sent as a bearer credential, or a node token (`cbn:…`), which
        signs each request instead (wire/node_sig.py)."""
        self.url = url.rstrip("/")
        node = key is not None and key.startswith("cbn:")
        headers = {"Authorization": f"Bearer {key}"} if key and not node else None
        auth = NodeAuth(key) if key and node else None
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
        """`wait_s`: the server holds the request up to that long (`?wait=`): the read timeout covers it."""
        timeout: Any = httpx.USE_CLIENT_DEFAULT
        if wait_s:
            params = {**(params or {}), "wait": wait_s}
            timeout = httpx.Timeout(self._http.timeout.connect, read=wait_s + 30.0, write=30.0, pool=30.0)
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
