"""HTTP client for the Cubelet API over its unix socket (or TCP). Used by the CLI, the demo and tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from cubeaccel.wire.cubelet_api import ReservationView
from cubeaccel.wire.http_reply import reply_body
from cubeaccel.wire.node_sig import NodeAuth
from cubeaccel.wire.telemetry import add_request_id
from cubeaccel.wire.warm import WarmClaimBody, WarmDrainReply


class CubeletClient:
    def __init__(
        self, socket: Path | None = None, url: str | None = None, timeout: float = 30.0, token: str | None = None
    ) -> None:
        """`token`: the node token CubeMaster signs its requests to the Cubelet's TCP listener with (none on the
        unix socket)."""
        hooks = {"request": [add_request_id]}  # the caller's request id goes on (CubeMaster → Cubelet)
        if url is not None:
            auth = NodeAuth(token) if token else None
            self._http = httpx.Client(base_url=url, timeout=timeout, auth=auth, event_hooks=hooks)
        elif socket is not None:
            self._http = httpx.Client(
                transport=httpx.HTTPTransport(uds=str(socket)),
                base_url="http://cubelet",
                timeout=timeout,
                event_hooks=hooks,
            )
        else:
            raise ValueError("socket or url required")

    def request(
        self,
        method: str,
        path: str,
        json: Any = None,
        params: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> Any:
        """`timeout`: this call's, instead of the client's (the dashboard asks every node and waits little)."""
        wait = httpx.USE_CLIENT_DEFAULT if timeout is None else timeout
        return reply_body(self._http.request(method, path, json=json, params=params, headers=headers, timeout=wait))

    def devices(self) -> list[dict[str, Any]]:
        return list(self.request("GET", "/v1/devices")["devices"])

    def reserve(self, sandbox_id: str, count: int = 1, **extra: Any) -> dict[str, Any]:
        return dict(self.request("POST", "/v1/reservations", {"sandbox_id": sandbox_id, "count": count, **extra}))

    def claim_warm(self, body: WarmClaimBody) -> ReservationView:
        """`POST /v1/warm/claim`: 201 and the running sandbox, or a `CubeError` (409 `warm.no_match`, …)."""
        raw = body.model_dump(mode="json", by_alias=True, exclude_none=True)
        if body.workload_token is not None:
            raw["workload_token"] = body.workload_token.get_secret_value()
        return ReservationView.model_validate(self.request("POST", "/v1/warm/claim", raw))

    def warm_drain(self) -> WarmDrainReply:
        """`POST /v1/warm/drain`: the refill and claims stop; the unclaimed warm sandboxes enter the release path."""
        return WarmDrainReply.model_validate(self.request("POST", "/v1/warm/drain"))

    def warm_undrain(self) -> WarmDrainReply:
        return WarmDrainReply.model_validate(self.request("POST", "/v1/warm/undrain"))

    def start(self, sandbox_id: str) -> dict[str, Any]:
        return dict(self.request("POST", f"/v1/reservations/{quote(sandbox_id, safe='')}/start"))

    def release(self, sandbox_id: str) -> dict[str, Any]:
        return dict(self.request("DELETE", f"/v1/reservations/{quote(sandbox_id, safe='')}"))

    def reservation(self, sandbox_id: str) -> dict[str, Any]:
        return dict(self.request("GET", f"/v1/reservations/{quote(sandbox_id, safe='')}"))

    def events(self, since: int = 0, limit: int = 1000) -> dict[str, Any]:
        return dict(self.request("GET", "/v1/events", params={"since": since, "limit": limit}))

    def verb(
        self, device_id: str, verb: str, who: str, reason: str, request_id: str | None = None, **extra: Any
    ) -> dict[str, Any]:
        return dict(
            self.request(
                "POST",
                f"/v1/devices/{quote(device_id, safe='')}/{quote(verb, safe='')}",
                {"who": who, "reason": reason, **extra},
                headers={"x-request-id": request_id} if request_id else None,
            )
        )

    def capacity(self) -> dict[str, Any]:
        return dict(self.request("GET", "/v1/capacity"))

    def host(self) -> dict[str, Any]:
        return dict(self.request("GET", "/v1/host"))

    def health(self) -> dict[str, Any]:
        return dict(self.request("GET", "/v1/health"))

    def close(self) -> None:
        self._http.close()
