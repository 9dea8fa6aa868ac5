"""envd traffic that names its sandbox only by its access token (SDK 2.15's connected sandbox in plain-http mode)
is routed by a digest of the token: one lookup per request whether 10 or 10,000 sandboxes run, and a re-read of
CubeMaster's running list derives tokens only for the sandboxes it had not seen."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import Request

from cubeaccel.frontdoor import envd
from cubeaccel.frontdoor.envd import EnvdProxy
from cubeaccel.frontdoor.mapping import envd_token
from cubeaccel.transport.master_client import Call
from cubeaccel.wire.master_api import Sandbox, SandboxList

SECRET = b"s" * 32


class RunningMaster:
    def __init__(self, running: int) -> None:
        self.ids = [f"sb-{i}" for i in range(running)]
        self.reads = 0

    async def admin(self, call: Call[SandboxList]) -> SandboxList:
        self.reads += 1
        return SandboxList.model_construct(sandboxes=[Sandbox.model_construct(id=i) for i in self.ids])


def presenting(token: str) -> Request:
    headers = [(b"x-access-token", token.encode())]
    return Request({"type": "http", "method": "GET", "path": "/health", "query_string": b"", "headers": headers})


@pytest.mark.parametrize("running", [10, 10_000])
def test_a_token_only_request_costs_the_same_at_10_and_10000_running_sandboxes(
    running: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    master = RunningMaster(running)
    proxy = EnvdProxy(master, SECRET, None)  # type: ignore[arg-type]
    derived: list[str] = []

    def counted(secret: bytes, sandbox_id: str) -> str:
        derived.append(sandbox_id)
        return envd_token(secret, sandbox_id)

    monkeypatch.setattr(envd, "envd_token", counted)

    async def main() -> None:
        try:
            assert await proxy.token_sandbox(presenting("bogus")) is None  # first sight: the list is read
            assert master.reads == 1 and len(derived) == running
            derived.clear()
            assert await proxy.token_sandbox(presenting("bogus-again")) is None  # within the interval
            real = envd_token(SECRET, f"sb-{running - 1}")
            assert await proxy.token_sandbox(presenting(real)) == f"sb-{running - 1}"
            assert derived == [f"sb-{running - 1}"]  # one check of the sandbox the digest named, nothing else
            assert master.reads == 1
        finally:
            await proxy.aclose()

    asyncio.run(main())


def test_a_reread_derives_tokens_only_for_new_sandboxes_and_forgets_ended_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    master = RunningMaster(100)
    proxy = EnvdProxy(master, SECRET, None)  # type: ignore[arg-type]
    monkeypatch.setattr(envd, "RUNNING_REFRESH_S", 0.0)
    old = envd_token(SECRET, "sb-0")

    async def main() -> None:
        try:
            assert await proxy.token_sandbox(presenting(old)) == "sb-0"
            derived: list[str] = []

            def counted(secret: bytes, sandbox_id: str) -> str:
                derived.append(sandbox_id)
                return envd_token(secret, sandbox_id)

            monkeypatch.setattr(envd, "envd_token", counted)
            master.ids = [*master.ids[1:], "sb-new"]  # sb-0 ended, sb-new started
            assert await proxy.token_sandbox(presenting(envd_token(SECRET, "sb-new"))) == "sb-new"
            assert "sb-new" in derived and len(derived) <= 3  # the new one, and the checks of the hits
            assert await proxy.token_sandbox(presenting(old)) is None  # an ended sandbox's token routes nowhere
        finally:
            await proxy.aclose()

    asyncio.run(main())
