"""Nodes: the Cubelets' heartbeats, an admin's view and verbs (drain, undrain, reconcile), the devices of one node
(read and changed through its Cubelet), and the capacity the schedulable nodes offer: `/v1/nodes…`, `/v1/capacity`.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

import httpx
from fastapi import APIRouter, Request
from pydantic import ValidationError

from cubeaccel.master.api.access import DEVICE_VERBS
from cubeaccel.master.api.deps import Caller, MaintenanceDep, MasterDep, TruthDep
from cubeaccel.master.maintenance import reconcile_node
from cubeaccel.master.service import CubeMaster
from cubeaccel.model.ids import NODE_ID_RE
from cubeaccel.model.sandbox_states import NodeEvent, NodeState
from cubeaccel.protocol.errors import CubeError
from cubeaccel.transport.api_edges import json_body
from cubeaccel.transport.cubelet_client import CubeletClient
from cubeaccel.wire import master_api as W
from cubeaccel.wire.heartbeat import NodeNews
from cubeaccel.wire.master_api import OperatorBody
from cubeaccel.wire.warm import WarmDrainReply, WarmVerbFailure

router = APIRouter()


@router.put("/v1/nodes/{node}", response_model=W.HeartbeatAck, openapi_extra=json_body("Heartbeat"))
def heartbeat(
    node: str, body: dict[str, Any], master: MasterDep, maintenance: MaintenanceDep, truth: TruthDep
) -> W.HeartbeatAck:
    if body.get("node") != node or NODE_ID_RE.fullmatch(node) is None:
        raise CubeError("node.name_mismatch", f"heartbeat for {body.get('node')!r} sent to /v1/nodes/{node}", "api")
    beat = master.store.record_heartbeat(body, time.time(), master.config.staleness_s)  # validated the body
    state, returned = beat.state, beat.returned
    if returned:  # routine heartbeats reach the views within the cache's TTL; new or returning nodes at once
        master.cache.heard(beat)
        if maintenance is not None:
            maintenance.request_reconcile(node)
    try:  # what the node ended; a restart it came back from. The heartbeat is stored either way: a failure
        # here must not turn every later heartbeat into a 500 (the node would go stale); the next one retries
        truth.heard(node, NodeNews.model_validate(body))
    except Exception:
        logging.getLogger("cubeaccel.master").exception("node truth from %s's heartbeat not applied", node)
    return W.HeartbeatAck(node=node, state=NodeState(state))


def node_views(master: CubeMaster) -> list[W.NodeSummary]:
    now = time.time()
    views = sorted(master.cache.views(fresh=True), key=lambda v: v.name)
    return [v.summary(now, master.config.staleness_s, W.NodeSummary) for v in views]


@router.get("/v1/nodes", response_model=W.NodeList)
def nodes(master: MasterDep) -> W.NodeList:
    return W.NodeList(nodes=node_views(master))


@router.get("/v1/nodes/{node}", response_model=W.NodeReply)
def node(node: str, master: MasterDep) -> W.NodeReply:
    view = next((v for v in master.cache.views(fresh=True) if v.name == node), None)
    if view is None:
        raise CubeError("node.not_found", f"no node {node!r}", "api")
    return view.summary(time.time(), master.config.staleness_s, W.NodeReply)


@router.post("/v1/nodes/{node}/{verb}", response_model=W.NodeVerbReply)
def node_verb(
    node: str, verb: str, master: MasterDep, caller: Caller, body: OperatorBody | None = None
) -> W.NodeVerbReply:
    if verb == "reconcile":
        return W.NodeVerbReply.model_validate(reconcile_node(master, node))
    if verb not in ("drain", "undrain"):
        raise CubeError("api.unknown_verb", f"unknown node verb {verb!r}; known: drain, undrain, reconcile", "api")
    state = master.store.node_event(node, NodeEvent(verb))
    master.cache.invalidate()
    # `who` is the authenticated caller, not whatever the body's `who` says
    said = {"node": node, "state": state.value, "who": caller.label(), "warm": warm_verb(master, node, verb)}
    return W.NodeVerbReply.model_validate(said)


def warm_verb(master: CubeMaster, node: str, verb: str) -> WarmDrainReply | WarmVerbFailure:
    """A drain removes the node's warm sandboxes first (and stops their refill); undrain resumes it. The
    node's state changed either way: an unreachable Cubelet is reported, not an error of the drain."""
    try:
        reply: WarmDrainReply = forwarded(
            master, node, lambda c: c.warm_drain() if verb == "drain" else c.warm_undrain()
        )
        return reply
    except CubeError as e:
        return WarmVerbFailure(error=e.code, message=e.message)
    except ValidationError as e:  # a malformed answer: as the warm claim reads one, the Cubelet's failure
        return WarmVerbFailure(error="cubelet.unreachable", message=f"malformed reply: {e}"[:300])


def cubelet_of(master: CubeMaster, node: str) -> CubeletClient:
    view = next((v for v in master.cache.views(fresh=True) if v.name == node), None)
    if view is None:
        raise CubeError("node.not_found", f"no node {node!r}", "api")
    return master.client(view.cubelet_url)


def forwarded(master: CubeMaster, node: str, call: Any) -> Any:
    try:
        return call(cubelet_of(master, node))
    except httpx.HTTPError as e:
        raise CubeError(
            "cubelet.unreachable", f"node {node}'s Cubelet: {type(e).__name__}", "api", {"node": node}
        ) from e


@router.get("/v1/nodes/{node}/devices", response_model=W.NodeDevices)
def node_devices(node: str, master: MasterDep) -> W.NodeDevices:
    return W.NodeDevices(node=node, devices=forwarded(master, node, lambda c: c.devices()))


@router.post("/v1/nodes/{node}/devices/{device_id}/{verb}", response_model=W.NodeDevice)
def device_verb(
    node: str, device_id: str, verb: str, body: W.DeviceVerbBody, request: Request, master: MasterDep, caller: Caller
) -> W.NodeDevice:
    """quarantine | recover | disable | enable on one device of `node`, done by that node's Cubelet (its TCP
    API, with the node's token); the Cubelet's events and both audit logs name the admin's key."""
    if verb not in DEVICE_VERBS:
        raise CubeError("api.unknown_verb", f"unknown device verb {verb!r}; known: {sorted(DEVICE_VERBS)}", "api")
    rid = request.state.request_id
    restore = body.restore_driver
    dev = forwarded(
        master,
        node,
        lambda c: c.verb(device_id, verb, caller.label(), body.reason, request_id=rid, restore_driver=restore),
    )
    return W.NodeDevice(node=node, device=dev)


@router.get("/v1/capacity", response_model=W.Capacity)
def capacity(master: MasterDep) -> W.Capacity:
    ns = node_views(master)
    by_model: Counter[str] = Counter()
    free_model: Counter[str] = Counter()
    warm: Counter[str] = Counter()  # claimable warm sandboxes by template: capacity for matching creates
    for n in ns:
        for g in n.groups:
            name = f"{g.accel_class}/{g.labels.get('model', '?')}"
            by_model[name] += g.total
            free_model[name] += g.allocatable if n.schedulable else 0
        for p in n.warm_pools if n.schedulable else ():
            warm[p.template or p.key] += p.claimable
    return W.Capacity(
        nodes=len(ns),
        schedulable_nodes=sum(n.schedulable for n in ns),
        by_state=dict(Counter(str(n.state) for n in ns)),
        total=sum(by_model.values()),
        allocatable=sum(free_model.values()),
        models={k: W.ModelCapacity(total=by_model[k], allocatable=free_model[k]) for k in sorted(by_model)},
        warm=dict(warm),
    )
