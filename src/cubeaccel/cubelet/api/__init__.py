"""The Cubelet's HTTP routes, one `APIRouter` per resource; `cubelet/server.py` assembles them.

`deps` hands each route the parts it names; `gates` decide who may call (before the app runs) and `audit` writes
the request's audit row; `views` turns journal records into the replies. The routers: `node` (liveness, host,
capacity, metrics, dashboard), `devices` (reads and operator verbs), `reservations`, `warm_pools`, `events`,
`local_only` (what only the unix socket serves: shim reports, reconcile) and `workload` (the proxy to a sandbox's
workload service). `ROUTERS` in server.py includes them in the order the OpenAPI documents list them
(docs/openapi/cubelet-*.json).
"""
