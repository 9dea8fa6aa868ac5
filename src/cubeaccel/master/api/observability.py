"""Health, the Prometheus scrape and the dashboard (its static page and its data): `/v1/health`, `/metrics`,
`/dashboard`, `/v1/dashboard`. Who may read each: docs/decisions.md "Who may scrape"."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response
from fastapi.responses import HTMLResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from cubeaccel.master.api.deps import FeedDep, MaintenanceDep, MasterDep, MetricsDep
from cubeaccel.master.dashboard import PAGE
from cubeaccel.wire import master_api as W
from cubeaccel.wire.dashboard import Dashboard

# The page runs only its own inline script and talks only to this server; nothing may frame it.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src data:; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}

router = APIRouter()


@router.get("/metrics", include_in_schema=False)
def prometheus(metrics: MetricsDep) -> Response:
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/dashboard", include_in_schema=False)
def dashboard_page() -> HTMLResponse:
    """Self-contained (no external assets); the admin key is typed in, kept in the tab's sessionStorage."""
    return HTMLResponse(PAGE, headers=PAGE_HEADERS)


@router.get("/v1/dashboard", response_model=Dashboard)
def dashboard(feed: FeedDep) -> dict[str, Any]:
    return feed.snapshot()


@router.get("/v1/health", response_model=W.Health)
def health(master: MasterDep, maintenance: MaintenanceDep) -> W.Health:
    return W.Health(
        status="ok",
        schema_version=master.store.schema_version,
        db=master.store.dialect,
        errors=maintenance.last_errors if maintenance else [],
    )
