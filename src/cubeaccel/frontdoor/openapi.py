"""The OpenAPI document of the front door's E2B REST subset, built from its route table and the wire models.

The front door is a Starlette app (it also routes envd traffic, which has no OpenAPI), so nothing generates this
for it as FastAPI does for CubeMaster and the Cubelet. Every route in `app.REST_ROUTES` needs an entry in
`OPERATIONS`; a route without one fails the build of the document (and tests/unit/test_openapi_committed.py).
Every error is E2B's `Error` body, its message led by the catalogued code (docs/e2b.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from cubeaccel.frontdoor.app import REST_ROUTES
from cubeaccel.wire import e2b_api as E


@dataclass(frozen=True)
class Operation:
    summary: str
    status: int  # of a successful reply
    reply: type[BaseModel] | None = None  # None: no body (204), or `reply_schema`
    many: bool = False  # the reply is a list of `reply`
    body: type[BaseModel] | None = None
    body_required: bool = True
    query: tuple[str, ...] = ()
    reply_schema: dict[str, Any] | None = None


OPERATIONS = {
    "health": Operation("liveness (no key needed)", 200, reply_schema={"type": "object"}),
    "create": Operation("create a sandbox; answers once it is running", 201, E.SandboxCreated, body=E.NewSandbox),
    "list": Operation(
        "the caller's running sandboxes, a page at a time (`x-next-token`)",
        200,
        E.ListedSandbox,
        many=True,
        query=("metadata", "state", "limit", "order", "startedAfter", "template", "nextToken"),
    ),
    "get_info": Operation("one running sandbox of the caller", 200, E.SandboxDetail),
    "kill": Operation("delete a sandbox", 204),
    "set_timeout": Operation("the sandbox now expires `timeout` s from now", 204, body=E.TimeoutBody),
    "update_network": Operation(
        "the running sandbox's egress policy, replaced whole (omitted fields are cleared)",
        204,
        body=E.NetworkUpdate,
        body_required=False,
    ),
    "metrics": Operation(
        "the guest's samples within start/end", 200, E.SandboxMetric, many=True, query=("start", "end")
    ),
    "connect": Operation(
        "the access token of a running sandbox; `timeout` extends its lifetime",
        200,
        E.SandboxCreated,
        body=E.ConnectBody,
        body_required=False,
    ),
    "refused": Operation("refused: a GPU sandbox is never paused, snapshotted or cloned", 400),
}

MODELS: list[type[BaseModel]] = [
    E.Error,
    E.NewSandbox,
    E.ConnectBody,
    E.TimeoutBody,
    E.NetworkUpdate,
    E.SandboxCreated,
    E.ListedSandbox,
    E.SandboxDetail,
    E.SandboxMetric,
]


def _ref(model: type[BaseModel]) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _operation(method: str, path: str, name: str) -> dict[str, Any]:
    op = OPERATIONS[name]
    error = {
        "description": "E2B's error body; the message starts with the catalogued code",
        "content": _json(_ref(E.Error)),
    }
    params = [
        {"name": p, "in": "path", "required": True, "schema": {"type": "string"}} for p in re.findall(r"{(\w+)}", path)
    ]
    params += [{"name": q, "in": "query", "required": False, "schema": {"type": "string"}} for q in op.query]
    if name != "health":
        params.append({"name": "X-API-Key", "in": "header", "required": True, "schema": {"type": "string"}})
    if op.status == 400:
        responses: dict[str, Any] = {"400": error}
    else:
        ok: dict[str, Any] = {"description": op.summary}
        if op.reply is not None:
            ok["content"] = _json({"type": "array", "items": _ref(op.reply)} if op.many else _ref(op.reply))
        elif op.reply_schema is not None:
            ok["content"] = _json(op.reply_schema)
        responses = {str(op.status): ok, "default": error}
    out: dict[str, Any] = {
        "summary": op.summary,
        "operationId": f"{name}_{method.lower()}_{re.sub('[^a-z0-9]+', '_', path.lower()).strip('_')}",
        "responses": responses,
    }
    if params:
        out["parameters"] = params
    if op.body is not None:
        out["requestBody"] = {"required": op.body_required, "content": _json(_ref(op.body))}
    return out


def e2b_openapi() -> dict[str, Any]:
    _, schemas = models_json_schema(
        [(m, "serialization" if issubclass(m, E.E2BReply) else "validation") for m in MODELS],
        ref_template="#/components/schemas/{model}",
    )
    paths: dict[str, dict[str, Any]] = {}
    for method, path, name in REST_ROUTES:
        paths.setdefault(path, {})[method.lower()] = _operation(method, path, name)
    return {
        "openapi": "3.1.0",
        "info": {"title": "cubeaccel front door (E2B REST subset)", "version": "1"},
        "paths": paths,
        "components": {"schemas": schemas.get("$defs", {})},
    }
