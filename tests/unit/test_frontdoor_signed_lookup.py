"""A signed `/files` URL in plain-http mode names no sandbox, so the front door finds the running sandbox whose token
signed it. Anyone may send such URLs (no key is needed), so however many forged ones arrive at once, CubeMaster's
running list is read at most once per refresh interval (frontdoor/envd.py `signed_sandbox`)."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request

from cubeaccel.frontdoor.envd import EnvdProxy


class CountingMaster:
    """CubeMaster's admin route as the proxy sees it, slow enough for every forged request to arrive meanwhile."""

    def __init__(self) -> None:
        self.calls = 0

    async def admin(self, method: str, path: str) -> dict[str, Any]:
        self.calls += 1
        await asyncio.sleep(0.05)  # a network round trip, so the concurrent requests overlap it
        return {"sandboxes": [{"id": f"sb-{i}"} for i in range(3)]}


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
