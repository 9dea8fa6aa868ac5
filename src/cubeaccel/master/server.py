"""CubeMaster HTTP API (FastAPI): users, operators and Cubelet heartbeats. Shapes in docs/master.md.

Errors have the Cubelet's format: `{"error": {"code", "layer", "message", "details"}}` with a status.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, Literal

from fastapi import FastAPI, Request, Response
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from cubeaccel.api_edges import install_api_edges
from cubeaccel.master.maintenance import Maintenance, reconcile_node
from cubeaccel.master.service import CreateSpec, CubeMaster, sandbox_json
from cubeaccel.model.errors import CubeError
from cubeaccel.model.ids import NODE_ID_RE, SANDBOX_ID_RE
from cubeaccel.model.request import AcceleratorChoice, AcceleratorRequest, parse_accelerators, parse_shorthand
from cubeaccel.model.sandbox_states import NodeEvent, SandboxState

SANDBOX_STATES = tuple(s.value for s in SandboxState)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StatusError(_Strict):
    code: str = Field(min_length=1, max_length=200)
    layer: str = Field(min_length=1, max_length=64)
    message: str = Field(default="", max_length=2000)
    phase: str | None = Field(default=None, max_length=32)  # the Cubelet phase it failed in


class StatusBody(_Strict):
    phase: Literal["running", "failed"]
    error: StatusError | None = None


class SandboxBody(_Strict):
    id: str | None = None
    template: str | None = Field(default=None, min_length=1, max_length=401)
    accelerators: Any = None
    gpu: Any = None
    memory_mib: StrictInt | None = Field(default=None, ge=64, le=16 << 20)
    vcpus: StrictInt = Field(default=1, ge=1, le=256)
    timeout_s: float | None = Field(default=None, gt=0, le=30 * 86400)
    tenant: str = Field(default="default", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=200)


class OperatorBody(_Strict):
    """Like the Cubelet's operator body, but `reason` may be left out (node verbs need none); empty is a 422."""

    who: str = Field(default="operator", min_length=1, max_length=200)
    reason: str | None = Field(default=None, min_length=1, max_length=2000)


class DefaultBody(_Strict):
    template: str = Field(min_length=1, max_length=200)


def create_spec(body: SandboxBody, header_key: str | None) -> CreateSpec:
    if body.id is not None and SANDBOX_ID_RE.fullmatch(body.id) is None:
        raise CubeError(
            "sandbox.invalid_id", f"invalid sandbox id {body.id!r}: [A-Za-z0-9._-], 1-63 chars", "api", {}, 422
        )
    if body.gpu is not None and body.accelerators is not None:
        raise CubeError("request.ambiguous_accelerators", "give either gpu (shorthand) or accelerators", "api", {}, 422)
    request: AcceleratorRequest | None = None
    if body.gpu is not None:
        request = parse_shorthand(body.gpu)
    elif body.accelerators is not None:
        request = parse_accelerators(body.accelerators)
    key = header_key or body.idempotency_key
    return CreateSpec(
        body.id,
        body.tenant,
        key,
        body.template,
        request or AcceleratorRequest(()),
        body.memory_mib,
        body.vcpus,
        body.timeout_s,
    )


def create_app(master: CubeMaster, maintenance: Maintenance | None = None) -> FastAPI:
    app = FastAPI(title="cubeaccel CubeMaster", version="1")

    install_api_edges(app)

    cfg = master.config

    @app.get("/v1/health")
    def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "schema_version": master.store.schema_version,
            "db": master.store.dialect,
            "errors": maintenance.last_errors if maintenance else [],
        }

    # ---- nodes ------------------------------------------------------------------------------------
    @app.put("/v1/nodes/{node}")
    def heartbeat(node: str, body: dict[str, Any]) -> dict[str, Any]:
        if body.get("node") != node or NODE_ID_RE.fullmatch(node) is None:
            raise CubeError(
                "node.name_mismatch", f"heartbeat for {body.get('node')!r} sent to /v1/nodes/{node}", "api", {}, 422
            )
        state, returned = master.store.heartbeat(body, time.time(), cfg.staleness_s)
        if returned:  # routine heartbeats reach the views within the cache's TTL; new nodes at once
            master.cache.invalidate()
            if maintenance is not None:
                maintenance.request_reconcile(node)
        return {"node": node, "state": state}

    def node_views() -> list[dict[str, Any]]:
        now = time.time()
        return [
            v.summary_json(now, cfg.staleness_s) for v in sorted(master.cache.views(fresh=True), key=lambda v: v.name)
        ]

    @app.get("/v1/nodes")
    def nodes() -> dict[str, Any]:
        return {"nodes": node_views()}

    @app.get("/v1/nodes/{node}")
    def node(node: str) -> dict[str, Any]:
        for n in node_views():
            if n["node"] == node:
                return n
        raise CubeError("node.not_found", f"no node {node!r}", "api", {}, 404)

    @app.post("/v1/nodes/{node}/{verb}")
    def node_verb(node: str, verb: str, body: OperatorBody | None = None) -> dict[str, Any]:
        if verb == "reconcile":
            return reconcile_node(master, node)
        if verb not in ("drain", "undrain"):
            raise CubeError(
                "api.unknown_verb", f"unknown node verb {verb!r}; known: drain, undrain, reconcile", "api", {}, 404
            )
        state = master.store.node_event(node, NodeEvent(verb))
        master.cache.invalidate()
        return {"node": node, "state": state.value, "who": (body or OperatorBody()).who}

    @app.get("/v1/capacity")
    def capacity() -> dict[str, Any]:
        ns = node_views()
        by_model: Counter[str] = Counter()
        free_model: Counter[str] = Counter()
        for n in ns:
            for g in n["groups"]:
                name = f"{g['class']}/{g['labels'].get('model', '?')}"
                by_model[name] += g["total"]
                free_model[name] += g["allocatable"] if n["schedulable"] else 0
        return {
            "nodes": len(ns),
            "schedulable_nodes": sum(n["schedulable"] for n in ns),
            "by_state": dict(Counter(n["state"] for n in ns)),
            "total": sum(by_model.values()),
            "allocatable": sum(free_model.values()),
            "models": {k: {"total": by_model[k], "allocatable": free_model[k]} for k in sorted(by_model)},
        }

    # ---- templates --------------------------------------------------------------------------------
    @app.post("/v1/templates", status_code=201)
    def register_template(document: dict[str, Any], default: bool = False) -> dict[str, Any]:
        return master.registry.register(document, default)

    @app.get("/v1/templates")
    def templates() -> dict[str, Any]:
        return {"templates": master.registry.list(), "defaults": master.store.defaults()}

    @app.get("/v1/templates/{ref}")
    def template(ref: str) -> dict[str, Any]:
        return master.registry.show(ref)

    @app.delete("/v1/templates/{ref}")
    def delete_template(ref: str) -> dict[str, Any]:
        return master.registry.delete(ref)

    @app.put("/v1/template-defaults/{accel_class}")
    def set_default(accel_class: str, body: DefaultBody) -> dict[str, Any]:
        master.registry.set_default(accel_class, body.template)
        return {"class": accel_class, "template": body.template}

    # ---- sandboxes --------------------------------------------------------------------------------
    @app.post("/v1/sandboxes", status_code=201)
    def create(body: SandboxBody, request: Request, response: Response) -> dict[str, Any]:
        spec = create_spec(body, request.headers.get("idempotency-key"))
        if not spec.request.choices:
            if spec.template is None:
                raise CubeError(
                    "request.no_accelerator", "give gpu (e.g. 'H100:1'), accelerators or a template", "api", {}, 422
                )
            cls = master.registry.contract(spec.template).accel_class
            spec = CreateSpec(
                spec.sandbox_id,
                spec.tenant,
                spec.idempotency_key,
                spec.template,
                AcceleratorRequest((AcceleratorChoice(cls, 1),)),
                spec.memory_mib,
                spec.vcpus,
                spec.timeout_s,
            )
        row, created = master.create(spec)
        if not created:
            response.status_code = 200
        return sandbox_json(row)

    @app.get("/v1/sandboxes")
    def sandboxes(state: str | None = None, node: str | None = None) -> dict[str, Any]:
        if state is not None and state not in SANDBOX_STATES:
            raise CubeError(
                "api.invalid_state", f"unknown state {state!r}; known: {list(SANDBOX_STATES)}", "api", {}, 422
            )
        rows = master.store.sandboxes(states=(SandboxState(state),) if state else None, node=node)
        return {"sandboxes": [sandbox_json(r) for r in rows]}

    @app.get("/v1/sandboxes/{sandbox_id}")
    def sandbox(sandbox_id: str) -> dict[str, Any]:
        return sandbox_json(master.get(sandbox_id))

    @app.delete("/v1/sandboxes/{sandbox_id}", status_code=202)
    def delete(sandbox_id: str) -> dict[str, Any]:
        return sandbox_json(master.delete(sandbox_id))

    @app.put("/v1/nodes/{node}/sandboxes/{sandbox_id}/status")
    def sandbox_status(node: str, sandbox_id: str, body: StatusBody) -> dict[str, Any]:
        """Cubelet's push: the sandbox is ready (guest validated), or failed with code and layer."""
        if (body.phase == "failed") != (body.error is not None):
            raise CubeError(
                "api.invalid_request", "a failed status carries an error; a running one does not", "api", {}, 422
            )
        error = {} if body.error is None else body.error.model_dump()
        return {"state": master.node_status(node, sandbox_id, body.phase, error)}

    return app
