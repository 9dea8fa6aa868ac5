"""What CubeMaster's routes use, built once by `server.create_app` and handed to each route by FastAPI's `Depends`.

A route names the parts it reads as typed parameters (`master: MasterDep`, `caller: Caller`), so its signature
says what it touches. The parts live on `app.state` as one `MasterParts`, set before the first request. The
lookups are async on purpose: FastAPI runs a sync dependency in a worker thread, a hop per request for a read
of an attribute (and a heartbeat must find a worker free).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, FastAPI, Request

from cubeaccel.master.auth import Auth, Identity
from cubeaccel.master.dashboard import DashboardFeed
from cubeaccel.master.maintenance import Maintenance
from cubeaccel.master.metrics import MasterMetrics
from cubeaccel.master.node_truth import NodeTruth
from cubeaccel.master.service import CubeMaster


@dataclass(frozen=True)
class MasterParts:
    """One app's collaborators. `maintenance` None: no background jobs (unit tests that drive them by hand)."""

    master: CubeMaster
    maintenance: Maintenance | None
    metrics: MasterMetrics
    feed: DashboardFeed
    truth: NodeTruth

    def install(self, app: FastAPI) -> None:
        app.state.master_parts = self


def parts_of(request: Request) -> MasterParts:
    parts = request.app.state.master_parts
    assert isinstance(parts, MasterParts), "create_app installs the parts before serving"
    return parts


async def master_of(request: Request) -> CubeMaster:
    return parts_of(request).master


async def auth_of(request: Request) -> Auth:
    return parts_of(request).master.auth


async def maintenance_of(request: Request) -> Maintenance | None:
    return parts_of(request).maintenance


async def metrics_of(request: Request) -> MasterMetrics:
    return parts_of(request).metrics


async def feed_of(request: Request) -> DashboardFeed:
    return parts_of(request).feed


async def truth_of(request: Request) -> NodeTruth:
    return parts_of(request).truth


async def caller_of(request: Request) -> Identity:
    """The caller `access.authorize` authenticated (it runs before every route's own dependencies)."""
    ident = request.state.identity
    assert isinstance(ident, Identity)
    return ident


MasterDep = Annotated[CubeMaster, Depends(master_of)]
AuthDep = Annotated[Auth, Depends(auth_of)]
MaintenanceDep = Annotated[Maintenance | None, Depends(maintenance_of)]
MetricsDep = Annotated[MasterMetrics, Depends(metrics_of)]
FeedDep = Annotated[DashboardFeed, Depends(feed_of)]
TruthDep = Annotated[NodeTruth, Depends(truth_of)]
Caller = Annotated[Identity, Depends(caller_of)]
