"""Warm sandboxes (docs/warm.md): a reservation served from the node's warm pool (claim), and the pools
themselves (read, size, drain, undrain). The pools' rules are in cubelet/warm.py."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from cubeaccel.cubelet.api.deps import CubeletDep, LocalDep
from cubeaccel.cubelet.api.views import reservation_request, reservation_view
from cubeaccel.cubelet.lifecycle import Cubelet
from cubeaccel.wire import cubelet_api as W
from cubeaccel.wire.warm import WarmClaimBody, WarmDrainReply, WarmPoolBody, WarmPoolList

router = APIRouter()


@router.post("/v1/warm/claim", status_code=201, response_model=W.ReservationView)
async def claim_warm(body: WarmClaimBody, request: Request, cubelet: CubeletDep, local: LocalDep) -> W.ReservationView:
    """A reservation request served only from the node's warm pool: 201 and the running sandbox with its
    workload token, or 409 `warm.no_match` with `details.reason` (the caller takes the cold path)."""
    request.state.audit_fields = {"sandbox": body.sandbox_id, "tenant": body.tenant}
    return await run_in_threadpool(claim_now, cubelet, local, body)


def claim_now(cubelet: Cubelet, local: bool, body: WarmClaimBody) -> W.ReservationView:
    given = body.workload_token.get_secret_value() if body.workload_token else None
    _, token, ack = cubelet.warm.claim(body.sandbox_id, reservation_request(body), given, body.warm_id)
    hand_off = W.WarmHandOff(reseed_ms=ack.reseed_ms, rebind_ms=ack.rebind_ms, reseeded=ack.reseeded)
    return reservation_view(cubelet, body.sandbox_id, local, access_token=token, hand_off=hand_off)


@router.get("/v1/warm/pools", response_model=WarmPoolList)
def warm_pools(cubelet: CubeletDep) -> WarmPoolList:
    warm = cubelet.warm
    return WarmPoolList(pools=warm.views(), max_concurrent_starts=warm.max_concurrent_starts, draining=warm.draining)


@router.post("/v1/warm/drain", response_model=WarmDrainReply)
def drain_warm(cubelet: CubeletDep) -> WarmDrainReply:
    return WarmDrainReply(draining=True, torn_down=cubelet.warm.drain())


@router.post("/v1/warm/undrain", response_model=WarmDrainReply)
def undrain_warm(cubelet: CubeletDep) -> WarmDrainReply:
    cubelet.warm.undrain()
    return WarmDrainReply(draining=False, torn_down=[])


@router.put("/v1/warm/pools", response_model=WarmPoolList)
def set_warm_pool(body: WarmPoolBody, cubelet: CubeletDep) -> WarmPoolList:
    cubelet.warm.set_pool(cubelet.pool_request(body), body.size)
    return warm_pools(cubelet)
