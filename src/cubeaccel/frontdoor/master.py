"""The front door's CubeMaster client: REST calls carry the caller's own API key (CubeMaster authenticates and
scopes them: another tenant's sandbox is a 404 there), envd routing uses the front door's admin key."""

from __future__ import annotations

import hashlib
from typing import Any

import httpx

from cubeaccel.frontdoor.mapping import Refusal, refusal_from_master

MAX_PREFIXES = 4096


class MasterClient:
    def __init__(self, url: str, admin_key: str, timeout_s: float = 30.0) -> None:
        self.admin_key = admin_key
        self.http = httpx.AsyncClient(base_url=url.rstrip("/"), timeout=timeout_s)
        self.prefixes: dict[str, str] = {}  # sha256 of a key → its tenant's sandbox id prefix

    async def id_prefix(self, key: str) -> str:
        """The start of every sandbox id this key may choose (its tenant's namespace: docs/security.md); asked
        of CubeMaster once per key. An admin key chooses any id: `sb-`."""
        digest = hashlib.sha256(key.encode()).hexdigest()
        if digest not in self.prefixes:
            me = await self.call("GET", "/v1/whoami", key)
            if len(self.prefixes) >= MAX_PREFIXES:
                self.prefixes.pop(next(iter(self.prefixes)))
            self.prefixes[digest] = str((me or {}).get("sandbox_id_prefix") or "sb-")
        return self.prefixes[digest]

    async def aclose(self) -> None:
        await self.http.aclose()

    async def call(
        self,
        method: str,
        path: str,
        key: str,
        body: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        params: dict[str, str] | None = None,
    ) -> Any:
        """The reply's JSON; a CubeMaster error is raised as the E2B refusal it maps to."""
        try:
            r = await self.http.request(
                method,
                path,
                json=body,
                params=params,
                headers={"Authorization": f"Bearer {key}", **(headers or {})},
            )
        except httpx.HTTPError as e:
            raise Refusal(503, f"cubeaccel (api): CubeMaster unreachable: {type(e).__name__}", retry=True) from e
        try:
            data = r.json()
        except ValueError:
            data = None
        if r.status_code >= 400:
            raise refusal_from_master(r.status_code, data)
        return data

    async def admin(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        return await self.call(method, path, self.admin_key, body)
