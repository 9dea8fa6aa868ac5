"""CubeMaster HTTP API (FastAPI): users, operators and Cubelet heartbeats. Shapes in docs/master.md.

Assembly only: the routes live in `master/api/` (one router per resource, their parts injected by
`api/deps.py`), the access rule and the audit row in `api/access.py`.
Errors have the Cubelet's format: `{"error": {"code", "layer", "message", "details"}}` with a status.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI

from cubeaccel.host.service.audit import AuditLog
from cubeaccel.master.api import audit as audit_routes
from cubeaccel.master.api import credentials, identities, nodes, observability, sandboxes, templates
from cubeaccel.master.api.access import AuditedRequests, RequestAudit, authorize
from cubeaccel.master.api.deps import MasterParts
from cubeaccel.master.auth import DatabaseSeal
from cubeaccel.master.dashboard import DashboardFeed
from cubeaccel.master.maintenance import Maintenance
from cubeaccel.master.metrics import metrics_of
from cubeaccel.master.node_truth import NodeTruth
from cubeaccel.master.service import CubeMaster
from cubeaccel.transport.api_edges import api_app
from cubeaccel.wire.heartbeat import Heartbeat
from cubeaccel.wire.templates import TemplateDocument

# In the order the OpenAPI document lists their paths. `credentials` before `nodes`: a route matches in the order
# it was added, and `POST /v1/nodes/{node}/{verb}` would take `credential` for a verb.
ROUTERS: tuple[APIRouter, ...] = (
    identities.router,
    audit_routes.router,
    credentials.router,
    observability.router,
    nodes.router,
    templates.router,
    sandboxes.router,
)


def create_app(
    master: CubeMaster, maintenance: Maintenance | None = None, audit: AuditLog | Path | None = None
) -> FastAPI:
    """`audit`: the audit log (a path or an open log); None keeps none (unit tests that do not look at it)."""
    metrics = metrics_of(master)
    feed = DashboardFeed(master)
    truth = NodeTruth(master, maintenance.request_reconcile if maintenance is not None else None)
    app = api_app("cubeaccel CubeMaster", body_models=(Heartbeat, TemplateDocument), telemetry=metrics.api)
    MasterParts(master, maintenance, metrics, feed, truth).install(app)
    log = AuditLog(audit, sealers=[DatabaseSeal(master.store)]) if isinstance(audit, Path) else audit
    app.router.dependencies.append(Depends(authorize))  # before the routers: each route takes it as they join
    app.add_middleware(AuditedRequests, hook=RequestAudit(log))
    for router in ROUTERS:
        app.include_router(router)
    return app
