"""The node as a whole: liveness (`liveness`, first in the documents), and host readiness with the pinned-memory
ledger, capacity, Prometheus metrics and the dashboard (`router`)."""

from __future__ import annotations

from fastapi import APIRouter
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

from cubeaccel.cubelet.api.deps import CubeletDep, HealthyDep, MetricsDep
from cubeaccel.cubelet.api.views import dashboard_view
from cubeaccel.cubelet.capacity import capacity_summary
from cubeaccel.cubelet.heartbeat import held, host_state
from cubeaccel.model.pinned_memory import QEMU_LOCKED_PER_VCPU_MIB
from cubeaccel.wire import cubelet_api as W
from cubeaccel.wire.capacity import CapacitySummary
from cubeaccel.wire.dashboard import NodeDashboard

liveness = APIRouter()
router = APIRouter()


@liveness.get("/v1/health", response_model=W.Health)
async def health(healthy: HealthyDep) -> W.Health:
    """On the event loop: a liveness probe needs no worker thread (and no store read)."""
    return healthy


@router.get("/v1/host", response_model=W.HostReply)
def host(cubelet: CubeletDep) -> W.HostReply:
    """Host readiness (the backend's host-wide checks) and the pinned-memory ledger."""
    readiness, led = host_state(cubelet)
    return W.HostReply(
        node=cubelet.config.node_name,
        backend=cubelet.backend.name,
        ready=readiness.ready,
        checked_at=readiness.checked_at,
        problems=[W.HostProblem(code=p.code, message=p.message) for p in (*readiness.problems, *held(cubelet))],
        pinned_memory=W.PinnedMemory(
            lockable_mib=led.lockable_mib,
            locked_mib=led.locked_mib,
            free_mib=led.free_mib,
            source=led.source,
            per_vmm_limit_mib=led.per_vmm_limit_mib,
            vmm_overhead_mib=led.vmm_overhead_mib,
            vmm_overhead_per_vcpu_mib=QEMU_LOCKED_PER_VCPU_MIB,
            sandboxes=dict(led.by_sandbox),
        ),
    )


@router.get("/v1/capacity", response_model=CapacitySummary)
def capacity(cubelet: CubeletDep) -> CapacitySummary:
    return capacity_summary(cubelet.store.devices(), cubelet.config.node_name, [cubelet.backend.name])


@router.get("/metrics", include_in_schema=False)
def prometheus(metrics: MetricsDep) -> Response:
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/dashboard", response_model=NodeDashboard)
def dashboard(cubelet: CubeletDep, events: int = 50) -> NodeDashboard:
    """Devices, reservations with their cold-start waterfall, and the newest events: CubeMaster's page."""
    return dashboard_view(cubelet, max(0, min(events, 500)))
