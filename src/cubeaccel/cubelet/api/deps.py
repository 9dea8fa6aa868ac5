"""What the Cubelet's routes use, built once per listener by `server.create_app` and handed to each route by
FastAPI's `Depends`.

A route names the parts it reads as typed parameters (`cubelet: CubeletDep`, `local: LocalDep`), so its signature
says what it touches. One Cubelet serves two listeners that differ in what they show (`local`: the unix socket
shows start nonces, TCP does not), so the parts belong to the app, not the module: they live on `app.state` as one
`CubeletParts`, installed before the first request and read back only here, checked by type. The lookups are async
on purpose: FastAPI runs a sync dependency in a worker thread, a hop per request for a read of an attribute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, FastAPI, Request

from cubeaccel.cubelet.api.workload_upstreams import WorkloadUpstreams
from cubeaccel.cubelet.lifecycle import Cubelet
from cubeaccel.cubelet.metrics import CubeletMetrics
from cubeaccel.wire import cubelet_api as W


@dataclass(frozen=True)
class CubeletParts:
    """One listener's collaborators. `local`: the root-only unix socket (start nonces shown, shim reports and
    reconcile served). `healthy`: the liveness reply, made once (the journal's schema cannot change after the
    store opened). `upstreams`: the workload proxy's pooled connections to each sandbox's shim."""

    cubelet: Cubelet
    local: bool
    metrics: CubeletMetrics
    healthy: W.Health
    upstreams: WorkloadUpstreams

    def install(self, app: FastAPI) -> None:
        app.state.cubelet_parts = self

    @staticmethod
    def of(app: FastAPI) -> CubeletParts:
        parts = app.state.cubelet_parts
        assert isinstance(parts, CubeletParts), "create_app installs the parts before serving"
        return parts


async def cubelet_of(request: Request) -> Cubelet:
    return CubeletParts.of(request.app).cubelet


async def local_of(request: Request) -> bool:
    return CubeletParts.of(request.app).local


async def metrics_of(request: Request) -> CubeletMetrics:
    return CubeletParts.of(request.app).metrics


async def healthy_of(request: Request) -> W.Health:
    return CubeletParts.of(request.app).healthy


async def upstreams_of(request: Request) -> WorkloadUpstreams:
    return CubeletParts.of(request.app).upstreams


CubeletDep = Annotated[Cubelet, Depends(cubelet_of)]
LocalDep = Annotated[bool, Depends(local_of)]
MetricsDep = Annotated[CubeletMetrics, Depends(metrics_of)]
HealthyDep = Annotated[W.Health, Depends(healthy_of)]
UpstreamsDep = Annotated[WorkloadUpstreams, Depends(upstreams_of)]
