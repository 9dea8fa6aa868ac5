"""The front door's CubeMaster client: REST calls carry the caller's own API key (CubeMaster authenticates and
scopes them: another tenant's sandbox is a 404 there), envd routing uses the front door's admin key."""

from __future__ import annotations

import hashlib

import httpx
from pydantic import ValidationError

from cubeaccel.frontdoor.mapping import Refusal, refusal_from_master
from cubeaccel.protocol.errors import CubeError
from cubeaccel.transport.http_reply import UNREADABLE_ERROR
from cubeaccel.transport.master_client import AsyncMasterClient, Call, Calls, ReplyT

MAX_PREFIXES = 4096


class FrontDoorMaster:
    """`transport.master_client.AsyncMasterClient` with the front door's needs on top: a CubeMaster error raised
    as the E2B refusal it maps to, each tenant's sandbox id prefix, asked once per key, and failover between
    CubeMaster replicas.

    `url` is one CubeMaster URL or several, comma-separated (replicas on one database). A call goes to the
    replica that answered last; one that cannot be reached is skipped for the next. A request that may have
    reached a replica that then failed (the connection broke after it was sent) is sent again elsewhere only
    when repeating it is harmless: a read, or a create carrying an Idempotency-Key (the replicas share its
    record); otherwise the caller gets the 503 "CubeMaster unreachable" with Should-Retry, as with one replica."""

    def __init__(self, url: str, admin_key: str, timeout_s: float = 30.0) -> None:
        self.admin_key = admin_key
        self.urls = [u.strip() for u in url.split(",") if u.strip()]
        if not self.urls:
            raise ValueError("no CubeMaster URL")
        self.masters = [AsyncMasterClient(u, timeout=timeout_s) for u in self.urls]
        self._current = 0  # the replica that answered last
        self.prefixes: dict[str, str] = {}  # sha256 of a key → its tenant's sandbox id prefix

    async def id_prefix(self, key: str) -> str:
        """The start of every sandbox id this key may choose (its tenant's namespace: docs/security.md); asked
        of CubeMaster once per key. An admin key chooses any id: `sb-`."""
        digest = hashlib.sha256(key.encode()).hexdigest()
        if digest not in self.prefixes:
            me = await self.call(Calls.whoami(), key)
            if len(self.prefixes) >= MAX_PREFIXES:
                self.prefixes.pop(next(iter(self.prefixes)))
            self.prefixes[digest] = me.sandbox_id_prefix or "sb-"
        return self.prefixes[digest]

    async def aclose(self) -> None:
        for m in self.masters:
            await m.aclose()

    async def call(self, c: Call[ReplyT], key: str) -> ReplyT:
        """The reply as its model; a CubeMaster error is raised as the E2B refusal it maps to."""
        try:
            return await self._send(c, key)
        except httpx.HTTPError as e:
            raise Refusal(503, f"cubeaccel (api): CubeMaster unreachable: {type(e).__name__}", retry=True) from e
        except CubeError as e:  # an error body CubeMaster did not send is the 502 of "no error body"
            raise refusal_from_master(e.status, None if e.code == UNREADABLE_ERROR else e.to_json()) from e
        except ValidationError as e:  # a reply that is not what CubeMaster documents
            raise Refusal(502, f"cubeaccel (api): CubeMaster's reply to {c.method} {c.path} is malformed") from e

    async def _send(self, c: Call[ReplyT], key: str) -> ReplyT:
        start = self._current
        for k in range(len(self.masters)):
            i = (start + k) % len(self.masters)
            try:
                reply = await self.masters[i].call(c, key=key)
            except httpx.HTTPError as e:
                if k == len(self.masters) - 1 or not _may_resend(c, e):
                    raise
                continue
            self._current = i
            return reply
        raise AssertionError("unreachable: the loop returns or raises")

    async def admin(self, c: Call[ReplyT]) -> ReplyT:
        return await self.call(c, self.admin_key)


def _may_resend(c: Call[ReplyT], e: httpx.HTTPError) -> bool:
    """Whether `c` may go to another replica after `e`: never sent (no connection), or harmless to repeat."""
    if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
        return True
    keyed = any(h.lower() == "idempotency-key" for h in (c.headers or {}))
    return c.method in ("GET", "HEAD") or (c.method == "POST" and c.path == "/v1/sandboxes" and keyed)
