"""The front door given several CubeMaster replicas (`--master URL1,URL2`) fails over between them: a replica it
cannot reach is skipped, and a request that may have reached a replica that then broke is sent again only when
repeating it is harmless (a read, or a create with an Idempotency-Key, whose record the replicas share)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import pytest

from cubeaccel.frontdoor.mapping import Refusal
from cubeaccel.frontdoor.master import FrontDoorMaster
from cubeaccel.transport.master_client import Call, Calls
from cubeaccel.wire.master_api import WhoAmI

WHO = {"v": 1, "role": "tenant", "tenant": "t", "node": None, "key_id": "k", "sandbox_id_prefix": "t-"}


def replicas(*behaviours: Callable[[httpx.Request], httpx.Response]) -> tuple[FrontDoorMaster, list[list[str]]]:
    fd = FrontDoorMaster(",".join(f"http://127.0.0.{i + 1}:7700" for i in range(len(behaviours))), "admin")
    seen: list[list[str]] = [[] for _ in behaviours]
    for i, behave in enumerate(behaviours):

        def handler(
            request: httpx.Request, i: int = i, behave: Callable[..., httpx.Response] = behave
        ) -> httpx.Response:
            seen[i].append(request.method)
            return behave(request)

        fd.masters[i]._http = httpx.AsyncClient(base_url=fd.urls[i], transport=httpx.MockTransport(handler))
    return fd, seen


def down(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


def broke_after_send(request: httpx.Request) -> httpx.Response:
    raise httpx.ReadError("connection reset", request=request)


def answers(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json=WHO)


def run(fd: FrontDoorMaster, *calls: Call[WhoAmI]) -> list[WhoAmI | Refusal]:
    async def main() -> list[WhoAmI | Refusal]:
        out: list[WhoAmI | Refusal] = []
        try:
            for c in calls:
                try:
                    out.append(await fd.call(c, "key"))
                except Refusal as e:
                    out.append(e)
        finally:
            await fd.aclose()
        return out

    return asyncio.run(main())


def test_a_replica_that_cannot_be_reached_is_skipped_and_the_next_calls_go_to_the_one_that_answered() -> None:
    fd, seen = replicas(down, answers)
    got = run(fd, Calls.whoami(), Calls.whoami())
    assert [type(g) for g in got] == [WhoAmI, WhoAmI]
    assert seen == [["GET"], ["GET", "GET"]]


def keyed_create(key: str | None) -> Call[WhoAmI]:
    headers = {"Idempotency-Key": key} if key else None
    return Call("POST", "/v1/sandboxes", WhoAmI, {"gpu": "H100:1"}, headers=headers)


@pytest.mark.parametrize(("key", "resent"), [("k-1", True), (None, False)])
def test_a_create_that_broke_after_it_was_sent_is_resent_only_with_an_idempotency_key(
    key: str | None, resent: bool
) -> None:
    fd, seen = replicas(broke_after_send, answers)
    (got,) = run(fd, keyed_create(key))
    if resent:
        assert isinstance(got, WhoAmI) and seen == [["POST"], ["POST"]]
    else:
        assert isinstance(got, Refusal) and got.status == 503 and got.retry and seen == [["POST"], []]


def test_when_every_replica_is_down_the_caller_gets_503_with_should_retry() -> None:
    fd, seen = replicas(down, down)
    (got,) = run(fd, Calls.whoami())
    assert isinstance(got, Refusal) and got.status == 503 and got.retry and seen == [["GET"], ["GET"]]
