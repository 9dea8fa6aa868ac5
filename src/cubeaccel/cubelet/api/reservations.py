"""Reservations: a sandbox's devices held on this node, from the request that assigns them to the release that
gives them back. `create` (POST /v1/reservations) is its own router only because the documents list the warm
routes between it and the rest (`router`).

The hot routes (reserve, release) are async with one worker-thread hand-off for the blocking work: a sync route
would take a second one just to check its reply against the response model."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from cubeaccel.cubelet import network_update
from cubeaccel.cubelet.api.deps import CubeletDep, LocalDep, MetricsDep
from cubeaccel.cubelet.api.views import release_view, reservation_request, reservation_view, shown
from cubeaccel.cubelet.lifecycle import Cubelet, validate_sandbox_id
from cubeaccel.cubelet.metrics import CubeletMetrics
from cubeaccel.cubelet.warm import refuse_reserved_id
from cubeaccel.model.lifecycle_ops import refuse
from cubeaccel.protocol.errors import CubeError
from cubeaccel.wire import cubelet_api as W

create = APIRouter()
router = APIRouter()


@create.post("/v1/reservations", status_code=201, response_model=W.ReservationView)
async def create_reservation(
    body: W.ReservationBody, request: Request, cubelet: CubeletDep, metrics: MetricsDep, local: LocalDep
) -> W.ReservationView:
    request.state.audit_fields = {"sandbox": body.sandbox_id, "tenant": body.tenant}  # the request's own entry
    return await run_in_threadpool(reserve_now, cubelet, metrics, local, body)


def reserve_now(cubelet: Cubelet, metrics: CubeletMetrics, local: bool, body: W.ReservationBody) -> W.ReservationView:
    req = reservation_request(body)
    try:
        cubelet.reserve(refuse_reserved_id(body.sandbox_id), req, capacity_wait_s=body.capacity_wait_s or 0.0)
    except CubeError as e:
        metrics.refused(e.code)
        raise
    if body.start:
        cubelet.start(body.sandbox_id, body.workload_token.get_secret_value() if body.workload_token else None)
    return reservation_view(cubelet, body.sandbox_id, local, access_token=cubelet.take_token(body.sandbox_id))


@router.get("/v1/reservations", response_model=W.ReservationList)
def reservations(cubelet: CubeletDep, local: LocalDep) -> W.ReservationList:
    return W.ReservationList(reservations=[shown(r, local) for r in cubelet.store.reservations()])


@router.get("/v1/reservations/{sandbox_id}", response_model=W.ReservationView)
def reservation(sandbox_id: str, cubelet: CubeletDep, local: LocalDep) -> W.ReservationView:
    cubelet.get_reservation(sandbox_id)
    return reservation_view(cubelet, sandbox_id, local)


@router.post("/v1/reservations/{sandbox_id}/start", response_model=W.ReservationView)
def start(sandbox_id: str, cubelet: CubeletDep, local: LocalDep) -> W.ReservationView:
    cubelet.start(validate_sandbox_id(sandbox_id))
    return reservation_view(cubelet, sandbox_id, local, access_token=cubelet.take_token(sandbox_id))


@router.put("/v1/reservations/{sandbox_id}/network", response_model=W.ReservationView)
def set_network(sandbox_id: str, body: W.NetworkUpdateBody, cubelet: CubeletDep, local: LocalDep) -> W.ReservationView:
    """A running sandbox's egress policy, changed in place: journaled, then loaded as one nft transaction
    (cubelet/network_update.py); the reservation with its new effective policy."""
    network_update.set_network(cubelet, validate_sandbox_id(sandbox_id), body.network)
    return reservation_view(cubelet, sandbox_id, local)


@router.post("/v1/reservations/{sandbox_id}/{operation}")
def lifecycle_operation(sandbox_id: str, operation: str, cubelet: CubeletDep) -> dict[str, Any]:
    """snapshot, clone, rollback, pause, resume, live_migration: refused for a sandbox holding a device."""
    res = cubelet.get_reservation(sandbox_id)
    raise refuse(operation, res.sandbox_id, has_accelerator=bool(res.device_ids))


@router.delete("/v1/reservations/{sandbox_id}", status_code=202, response_model=W.Release)
async def delete_reservation(sandbox_id: str, cubelet: CubeletDep, local: LocalDep) -> W.Release:
    return await run_in_threadpool(release_now, cubelet, local, sandbox_id)


def release_now(cubelet: Cubelet, local: bool, sandbox_id: str) -> W.Release:
    return release_view(cubelet, sandbox_id, cubelet.release(sandbox_id), local)
