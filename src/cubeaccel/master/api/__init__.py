"""CubeMaster's HTTP routes, one `APIRouter` per resource; `master/server.py` assembles them.

`access` decides who may call what and audits it, `deps` hands each route the parts it names; the routers
(`identities`, `audit`, `credentials`, `observability`, `nodes`, `templates`, `sandboxes`) hold the handlers.
`ROUTERS` in server.py includes them in the order the OpenAPI document lists them (docs/openapi/cubemaster.json).
"""
