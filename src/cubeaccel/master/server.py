"""CubeMaster HTTP API (FastAPI): users, operators and Cubelet heartbeats. Shapes in docs/master.md.

Errors have the Cubelet's format: `{"error": {"code", "layer", "message", "details"}}` with a status.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from fastapi import FastAPI, Request, Response

from cubeaccel.master.maintenance import Maintenance, reconcile_node
from cubeaccel.master.service import CreateSpec, CubeMaster, sandbox_json
from cubeaccel.model.errors import CubeError
from cubeaccel.model.ids import NODE_ID_RE, SANDBOX_ID_RE
from cubeaccel.model.request import AcceleratorChoice, AcceleratorRequest, parse_accelerators, parse_shorthand
from cubeaccel.model.sandbox_states import NodeEvent, SandboxState
from cubeaccel.wire import master_api as W
from cubeaccel.wire.api_edges import api_app, json_body
from cubeaccel.wire.heartbeat import Heartbeat
from cubeaccel.wire.master_api import OperatorBody, SandboxBody
from cubeaccel.wire.templates import TemplateDocument

SANDBOX_STATES = tuple(s.value for s in SandboxState)
MAX_IDEMPOTENCY_KEY = 200  # the body field's bound and the column's width


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
    if header_key is not None and not (0 < len(header_key) <= MAX_IDEMPOTENCY_KEY and header_key.isprintable()):
        raise CubeError(
            "request.invalid_idempotency_key",
            f"Idempotency-Key must be 1-{MAX_IDEMPOTENCY_KEY} printable characters, got {len(header_key)}",
            "api",
            {},
            422,
        )
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
    app = api_app("cubeaccel CubeMaster", body_models=(Heartbeat, TemplateDocument))

    cfg = master.config

    @app.get("/v1/health", response_model=W.Health)
    def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "schema_version": master.store.schema_version,
            "db": master.store.dialect,
            "errors": maintenance.last_errors if maintenance else [],
        }

    # ---- nodes ------------------------------------------------------------------------------------
    @app.put("/v1/nodes/{node}", response_model=W.HeartbeatAck, openapi_extra=json_body("Heartbeat"))
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

    @app.get("/v1/nodes", response_model=W.NodeList)
    def nodes() -> dict[str, Any]:
        return {"nodes": node_views()}

    @app.get("/v1/nodes/{node}", response_model=W.NodeReply)
    def node(node: str) -> dict[str, Any]:
        for n in node_views():
            if n["node"] == node:
                return n
        raise CubeError("node.not_found", f"no node {node!r}", "api", {}, 404)

    @app.post("/v1/nodes/{node}/{verb}", response_model=W.NodeVerbReply)
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

    @app.get("/v1/capacity", response_model=W.Capacity)
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
    @app.post(
        "/v1/templates",
        status_code=201,
        response_model=W.TemplateRegistered,
        openapi_extra=json_body("TemplateDocument"),
    )
    def register_template(document: dict[str, Any], default: bool = False) -> dict[str, Any]:
        return master.registry.register(document, default)

    @app.get("/v1/templates", response_model=W.TemplateList)
    def templates() -> dict[str, Any]:
        return {"templates": master.registry.list(), "defaults": master.store.defaults()}

    @app.get("/v1/templates/{ref}", response_model=W.TemplateShown)
    def template(ref: str) -> dict[str, Any]:
        return master.registry.show(ref)

    @app.delete("/v1/templates/{ref}", response_model=W.TemplateDeleted)
    def delete_template(ref: str) -> dict[str, Any]:
        return master.registry.delete(ref)

    @app.put("/v1/template-defaults/{accel_class}", response_model=W.DefaultSet)
    def set_default(accel_class: str, body: W.DefaultBody) -> dict[str, Any]:
        master.registry.set_default(accel_class, body.template)
        return {"class": accel_class, "template": body.template}

    # ---- sandboxes --------------------------------------------------------------------------------
    @app.post("/v1/sandboxes", status_code=201, response_model=W.SandboxReply)
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

    @app.get("/v1/sandboxes", response_model=W.SandboxList)
    def sandboxes(state: str | None = None, node: str | None = None) -> dict[str, Any]:
        if state is not None and state not in SANDBOX_STATES:
            raise CubeError(
                "api.invalid_state", f"unknown state {state!r}; known: {list(SANDBOX_STATES)}", "api", {}, 422
            )
        rows = master.store.sandboxes(states=(SandboxState(state),) if state else None, node=node)
        return {"sandboxes": [sandbox_json(r) for r in rows]}

    @app.get("/v1/sandboxes/{sandbox_id}", response_model=W.SandboxReply)
    def sandbox(sandbox_id: str) -> dict[str, Any]:
        return sandbox_json(master.get(sandbox_id))

    @app.delete("/v1/sandboxes/{sandbox_id}", status_code=202, response_model=W.SandboxReply)
    def delete(sandbox_id: str) -> dict[str, Any]:
        return sandbox_json(master.delete(sandbox_id))

    @app.put("/v1/nodes/{node}/sandboxes/{sandbox_id}/status", response_model=W.StatusReply)
    def sandbox_status(node: str, sandbox_id: str, body: W.StatusBody) -> dict[str, Any]:
        """Cubelet's push: the sandbox is ready (guest validated), or failed with code and layer."""
        if (body.phase == "failed") != (body.error is not None):
            raise CubeError(
                "api.invalid_request", "a failed status carries an error; a running one does not", "api", {}, 422
            )
        error = {} if body.error is None else body.error.model_dump()
        return {"state": master.node_status(node, sandbox_id, body.phase, error)}

    return app
