"""The E2B-compatible front door (`cubeaccel api serve`): E2B's REST surface over CubeMaster, and envd traffic
routed to the sandbox's node (docs/e2b.md).

Stateless: every answer comes from CubeMaster or is derived (the envd token from the sandbox id and the
front door's secret), so several replicas sharing the secret and the admin key may serve side by side.
Assembly only: the REST handlers live in `frontdoor/routes/` (one class per resource, built here with what it
uses), the choice between envd and REST in `frontdoor/envd_routing.py`, E2B's error replies in `errors.py`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.applications import Starlette
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from cubeaccel.frontdoor.config import FrontDoorConfig as FrontDoorConfig  # its importers' name for it
from cubeaccel.frontdoor.envd import EnvdProxy
from cubeaccel.frontdoor.envd_routing import EnvdRouting
from cubeaccel.frontdoor.errors import ON_ERROR, edge_error
from cubeaccel.frontdoor.master import FrontDoorMaster
from cubeaccel.frontdoor.routes import service
from cubeaccel.frontdoor.routes.metrics import Metrics
from cubeaccel.frontdoor.routes.sandboxes import Sandboxes
from cubeaccel.frontdoor.unread_body import close_when_body_unread
from cubeaccel.transport.api_edges import EdgeGuard
from cubeaccel.transport.http_server import HttpLimits

# E2B's REST routes: (method, path, handler); frontdoor/openapi.py documents each (docs/openapi/frontdoor-e2b.json).
# Matched in this order: `/sandboxes/{sandbox_id}/{op}` only after the named verbs.
REST_ROUTES = [
    ("GET", "/health", "health"),
    ("POST", "/v2/sandboxes", "create"),
    ("POST", "/sandboxes", "create"),
    ("GET", "/v2/sandboxes", "list"),
    ("GET", "/sandboxes", "list"),
    ("GET", "/sandboxes/{sandbox_id}", "get_info"),
    ("DELETE", "/sandboxes/{sandbox_id}", "kill"),
    ("POST", "/sandboxes/{sandbox_id}/timeout", "set_timeout"),
    ("PUT", "/sandboxes/{sandbox_id}/network", "update_network"),
    ("GET", "/sandboxes/{sandbox_id}/metrics", "metrics"),
    ("POST", "/v2/sandboxes/{sandbox_id}/connect", "connect"),
    ("POST", "/sandboxes/{sandbox_id}/connect", "connect"),
    ("POST", "/sandboxes/{sandbox_id}/{op}", "refused"),
    ("GET", "/snapshots", "refused"),
    ("POST", "/snapshots", "refused"),
]


class ClosingClients:
    """The REST app's lifespan: the front door's clients (their connection pools) closed when it stops."""

    def __init__(self, envd: EnvdProxy, master: FrontDoorMaster) -> None:
        self.envd = envd
        self.master = master

    @contextlib.asynccontextmanager
    async def __call__(self, app: Starlette) -> AsyncIterator[None]:
        yield
        await self.envd.aclose()
        await self.master.aclose()


def create_app(cfg: FrontDoorConfig) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    master = FrontDoorMaster(cfg.master_url, cfg.admin_key)
    envd = EnvdProxy(master, cfg.secret, cfg.domain)
    handlers = {**service.HANDLERS, **Sandboxes(master, cfg).handlers(), **Metrics(master, envd).handlers()}
    routes = [Route(path, handlers[name], methods=[method]) for method, path, name in REST_ROUTES]
    rest = EdgeGuard(
        Starlette(routes=routes, lifespan=ClosingClients(envd, master), exception_handlers=ON_ERROR),
        body_timeout_s=HttpLimits.from_env().body_timeout_s,
        render=edge_error,
        streams=lambda path: False,
    )
    return close_when_body_unread(EnvdRouting(envd, rest))
