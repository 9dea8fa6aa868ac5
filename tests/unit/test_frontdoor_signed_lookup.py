"""A signed `/files` URL in plain-http mode names no sandbox, so the front door finds the running sandbox whose token
signed it. Anyone may send such URLs (no key is needed), so however many forged ones arrive at once, CubeMaster's
running list is read at most once per refresh interval (frontdoor/envd.py `signed_sandbox`)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import time
from urllib.parse import urlencode

from starlette.requests import Request

from cubeaccel.frontdoor.envd import SIGNATURE_EXPIRED, SIGNATURE_INVALID, EnvdProxy, signature_refusal
from cubeaccel.frontdoor.mapping import envd_token
from cubeaccel.transport.master_client import Call
from cubeaccel.wire.master_api import Sandbox, SandboxList


class CountingMaster:
    """CubeMaster's admin route as the proxy sees it, slow enough for every forged request to arrive meanwhile."""

    def __init__(self) -> None:
        self.calls = 0

    async def admin(self, call: Call[SandboxList]) -> SandboxList:
        assert (call.path, call.params) == ("/v1/sandboxes", {"state": "running"})
        self.calls += 1
        await asyncio.sleep(0.05)  # a network round trip, so the concurrent requests overlap it
        return SandboxList.model_construct(sandboxes=[Sandbox.model_construct(id=f"sb-{i}") for i in range(3)])


def forged(i: int) -> Request:
    query = f"path=%2Ftmp%2Fx&signature=v1_forged{i}".encode()
    return Request({"type": "http", "method": "GET", "path": "/files", "query_string": query, "headers": []})


def test_concurrent_forged_signed_urls_cost_one_running_list_read() -> None:
    master = CountingMaster()
    proxy = EnvdProxy(master, b"s" * 32, None)  # type: ignore[arg-type]

    async def main() -> list[str | None]:
        try:
            return await asyncio.gather(*(proxy.signed_sandbox(forged(i)) for i in range(50)))
        finally:
            await proxy.aclose()

    assert asyncio.run(main()) == [None] * 50
    assert master.calls == 1


def signed(token: str, expiration: int | None, path: str = "/tmp/x", signature: str | None = None) -> Request:
    """A `/files` read URL as the SDK signs it (envd's v1_: sha256 of path:operation:username:token[:exp])."""
    fields = [path, "read", "user", token, *([str(expiration)] if expiration is not None else [])]
    good = "v1_" + base64.b64encode(hashlib.sha256(":".join(fields).encode()).digest()).decode().rstrip("=")
    query = {"path": path, "username": "user", "signature": signature or good}
    if expiration is not None:
        query["signature_expiration"] = str(expiration)
    raw = urlencode(query).encode()
    return Request({"type": "http", "method": "GET", "path": "/files", "query_string": raw, "headers": []})


def test_a_signed_url_is_refused_in_envds_words_signature_first_then_expiration() -> None:
    """E2B's own test reads the body: `{"code": 401, "message": "signature is already expired"}`."""
    token, now = "tok", int(time.time())
    assert signature_refusal(signed(token, None), token) is None
    assert signature_refusal(signed(token, now + 120), token) is None
    assert signature_refusal(signed(token, now - 120), token) == SIGNATURE_EXPIRED
    assert signature_refusal(signed("other", now - 120), token) == SIGNATURE_INVALID  # not ours: never "expired"
    assert signature_refusal(signed(token, now + 120, signature="v1_forged"), token) == SIGNATURE_INVALID


def test_an_expired_url_in_plain_http_mode_finds_its_sandbox_so_the_refusal_can_say_expired() -> None:
    master = CountingMaster()
    proxy = EnvdProxy(master, b"s" * 32, None)  # type: ignore[arg-type]
    token = envd_token(b"s" * 32, "sb-1")

    async def main() -> list[str | None]:
        try:
            return [
                await proxy.signed_sandbox(signed(token, int(time.time()) - 120)),
                await proxy.signed_sandbox(signed("not-a-sandbox-token", int(time.time()) - 120)),
            ]
        finally:
            await proxy.aclose()

    assert asyncio.run(main()) == ["sb-1", None]
