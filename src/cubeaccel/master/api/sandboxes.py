"""Sandboxes: create (waiting, if asked, until it settles), list, show, its start phases, its workload endpoint
and token, timeout, network, delete; and the Cubelet's push of a sandbox's status: `/v1/sandboxes…`,
`/v1/nodes/{node}/sandboxes/{sandbox_id}/status`. A tenant sees only its own sandboxes (`owned`)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from urllib.parse import quote

from fastapi import APIRouter, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from cubeaccel.master import sandbox_network
from cubeaccel.master.api.deps import AuthDep, Caller, MasterDep, MetricsDep
from cubeaccel.master.auth import DEFAULT_TENANT, TENANT, Identity, forbidden
from cubeaccel.master.metrics import MasterMetrics
from cubeaccel.master.node_truth import silent_nodes
from cubeaccel.master.records import SandboxRow
from cubeaccel.master.service import CreateSpec, CubeMaster, sandbox_error, sandbox_record
from cubeaccel.master.warm import WARM_STATE, warm_rows
from cubeaccel.model.ids import SANDBOX_ID_RE
from cubeaccel.model.request import AcceleratorRequest, for_template, parse_accelerators, parse_shorthand
from cubeaccel.model.sandbox_states import SETTLED_STATES, SandboxState
from cubeaccel.protocol.errors import CubeError
from cubeaccel.wire import master_api as W
from cubeaccel.wire.master_api import SandboxBody

SANDBOX_STATES = tuple(s.value for s in SandboxState)
MAX_IDEMPOTENCY_KEY = 200  # the body field's bound and the column's width
MAX_WAIT_S = 600.0  # `?wait=` on create and show: the longest a request is held open
WAIT_POLL_S = 0.1

router = APIRouter()


def create_spec(body: SandboxBody, header_key: str | None) -> CreateSpec:
    if body.id is not None and SANDBOX_ID_RE.fullmatch(body.id) is None:
        raise CubeError("sandbox.invalid_id", f"invalid sandbox id {body.id!r}: [A-Za-z0-9._-], 1-63 chars", "api")
    if body.gpu is not None and body.accelerators is not None:
        raise CubeError("request.ambiguous_accelerators", "give either gpu (shorthand) or accelerators", "api")
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
        )
    key = header_key or body.idempotency_key
    return CreateSpec(
        body.id,
        body.tenant or "default",
        key,
        body.template,
        request or AcceleratorRequest(()),
        body.memory_mib,
        body.vcpus,
        body.timeout_s,
        dict(body.metadata),
        dict(body.env_vars),
        body.workload_token,
        body.network,
    )


def owned(master: CubeMaster, ident: Identity, sandbox_id: str) -> SandboxRow:
    """A tenant sees only its own sandboxes: another tenant's is 404, as if it did not exist."""
    row = master.get(sandbox_id)
    if ident.role == TENANT and row.tenant != ident.tenant:
        raise CubeError("sandbox.not_found", f"no sandbox {sandbox_id!r}", "api")
    return row


async def settle(master: CubeMaster, sandbox_id: str, wait_s: float) -> SandboxRow:
    """The sandbox once it is running (guest validated, so its workload service is up: the shim waits for
    it before validation), failed (code and layer in `error`) or gone, or as it is when `wait_s` ends. Async
    so that a thousand waiting callers hold no worker thread (heartbeats must still get one)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        row = await run_in_threadpool(master.get, sandbox_id)
        if row.state in SETTLED_STATES or loop.time() >= deadline:
            return row
        await asyncio.sleep(WAIT_POLL_S)


WaitQuery = Query(0.0, ge=0.0, le=MAX_WAIT_S, description="seconds to wait until running, failed or gone")


@router.post("/v1/sandboxes", status_code=201, response_model=W.SandboxReply)
async def create(
    body: SandboxBody,
    request: Request,
    response: Response,
    master: MasterDep,
    metrics: MetricsDep,
    caller: Caller,
    wait: float = WaitQuery,
) -> W.SandboxReply:
    reply = await run_in_threadpool(create_now, master, metrics, caller, body, request, response)
    if wait > 0 and reply.state not in SETTLED_STATES:
        row = await settle(master, reply.id, wait)
        reply = sandbox_record(row, W.SandboxReply, access_token=reply.access_token)
    return reply


def create_now(
    master: CubeMaster, metrics: MasterMetrics, ident: Identity, body: SandboxBody, request: Request, response: Response
) -> W.SandboxReply:
    if ident.role == TENANT:
        if body.tenant not in (None, ident.tenant):
            raise forbidden(f"tenant {ident.tenant}'s key cannot create for tenant {body.tenant}")
        body = body.model_copy(update={"tenant": ident.tenant})
        prefix = master.auth.sandbox_prefix(ident.tenant or "")
        if body.id is not None and not body.id.startswith(prefix):
            # Whether the id is free, another tenant's or deleted, the answer is this one: it says nothing of them.
            raise CubeError(
                "sandbox.id_outside_namespace",
                f"a sandbox id tenant {ident.tenant} chooses starts with {prefix!r} (GET /v1/whoami:"
                " sandbox_id_prefix); leave `id` out to have one made",
                "api",
                {"sandbox_id_prefix": prefix},
            )
    elif body.tenant is None:
        body = body.model_copy(update={"tenant": DEFAULT_TENANT})
    request.state.tenant = body.tenant
    spec = create_spec(body, request.headers.get("idempotency-key"))
    if not spec.request.choices:
        if spec.template is None:
            raise CubeError("request.no_accelerator", "give gpu (e.g. 'H100:1'), accelerators or a template", "api")
        cls = master.registry.contract(spec.template).accel_class
        spec = dataclasses.replace(spec, request=for_template(cls))
    t0 = time.perf_counter()
    try:
        row, created = master.create(spec)
    except CubeError as e:
        metrics.created("refused", time.perf_counter() - t0, e.code)
        raise
    metrics.created("created" if created else "replayed", time.perf_counter() - t0)
    if not created:
        response.status_code = 200
    token = master.issued_tokens.pop(str(row.id), None)
    return sandbox_record(row, W.SandboxReply, access_token=token)


@router.get("/v1/sandboxes", response_model=W.SandboxList)
def sandboxes(master: MasterDep, caller: Caller, state: str | None = None, node: str | None = None) -> W.SandboxList:
    if state == WARM_STATE:  # the nodes' warm sandboxes (no tenant's until claimed): an admin's view
        views = [v for v in master.cache.views() if node in (None, v.name)]
        return W.SandboxList(sandboxes=[] if caller.role == TENANT else list(warm_rows(views)))
    if state is not None and state not in SANDBOX_STATES:
        raise CubeError("api.invalid_state", f"unknown state {state!r}; known: {list(SANDBOX_STATES)}", "api")
    rows = master.store.sandboxes(states=(SandboxState(state),) if state else None, node=node)
    if caller.role == TENANT:
        rows = [r for r in rows if r.tenant == caller.tenant]
    silent = silent_nodes(master)
    return W.SandboxList(sandboxes=[sandbox_record(r, W.Sandbox, silent) for r in rows])


@router.get("/v1/sandboxes/{sandbox_id}", response_model=W.SandboxReply)
async def sandbox(sandbox_id: str, master: MasterDep, caller: Caller, wait: float = WaitQuery) -> W.SandboxReply:
    row = await run_in_threadpool(owned, master, caller, sandbox_id)
    if wait > 0 and row.state not in SETTLED_STATES:
        row = await settle(master, sandbox_id, wait)
    return sandbox_record(row, W.SandboxReply, silent_nodes(master))


@router.get("/v1/sandboxes/{sandbox_id}/events", response_model=W.SandboxEvents)
def sandbox_events(sandbox_id: str, master: MasterDep, caller: Caller) -> W.SandboxEvents:
    """The start phases the sandbox's node recorded, fetched with the node token (a user has none)."""
    row = owned(master, caller, sandbox_id)
    phases, answered = master.start_phases(row)
    return W.SandboxEvents(sandbox_id=sandbox_id, state=row.state, phases=phases, node_answered=answered)


def workload_of(master: CubeMaster, row: SandboxRow) -> W.WorkloadEndpoint:
    url = master.node_url(row.node) if row.state == SandboxState.RUNNING.value else None
    if url is None or row.node is None:
        raise CubeError(
            "workload.not_running",
            f"sandbox {row.id} is {row.state}, not running",
            "api",
            {"state": row.state},
        )
    base = f"{url.rstrip('/')}/v1/sandboxes/{quote(row.id, safe='')}/workload"
    return W.WorkloadEndpoint(sandbox_id=row.id, node=row.node, url=base)


@router.get("/v1/sandboxes/{sandbox_id}/workload", response_model=W.WorkloadEndpoint)
def sandbox_workload(sandbox_id: str, master: MasterDep, caller: Caller) -> W.WorkloadEndpoint:
    """The node's workload proxy for the caller's own running sandbox: a tenant's way to exec and copy, which
    needs no node route (those are admins')."""
    return workload_of(master, owned(master, caller, sandbox_id))


@router.post("/v1/sandboxes/{sandbox_id}/connect", response_model=W.WorkloadConnection)
def sandbox_connect(
    sandbox_id: str, request: Request, master: MasterDep, auth: AuthDep, caller: Caller
) -> W.WorkloadConnection:
    """The caller's own running sandbox's workload endpoint and access token: the owner's key is enough to
    obtain it, as E2B's connect gives it to the owner (the CLI's exec and cp need no `--token`). Only for a
    token CubeMaster derived: one the creator chose (the E2B front door's) is the creator's to give."""
    row = owned(master, caller, sandbox_id)
    request.state.tenant = row.tenant
    endpoint = workload_of(master, row)
    if row.token_salt is None:
        raise CubeError(
            "workload.token_unavailable",
            f"sandbox {sandbox_id}'s access token was chosen by its creator (the E2B front door gives it on"
            " connect) or predates tokens CubeMaster can give again: pass --token",
            "api",
        )
    token = auth.workload_token(row.id, row.token_salt)
    return W.WorkloadConnection(**endpoint.model_dump(exclude={"v"}), access_token=token)


@router.post("/v1/sandboxes/{sandbox_id}/timeout", response_model=W.SandboxReply)
def set_timeout(
    sandbox_id: str, body: W.TimeoutBody, request: Request, master: MasterDep, caller: Caller
) -> W.SandboxReply:
    request.state.tenant = owned(master, caller, sandbox_id).tenant
    return sandbox_record(master.set_timeout(sandbox_id, body.timeout_s), W.SandboxReply)


@router.put("/v1/sandboxes/{sandbox_id}/network", response_model=W.SandboxReply)
def set_network(
    sandbox_id: str, body: W.NetworkBody, request: Request, master: MasterDep, caller: Caller
) -> W.SandboxReply:
    """A running sandbox's egress policy, changed on its node, then recorded (master/sandbox_network.py)."""
    request.state.tenant = owned(master, caller, sandbox_id).tenant
    return sandbox_record(sandbox_network.set_network(master, sandbox_id, body.network), W.SandboxReply)


@router.delete("/v1/sandboxes/{sandbox_id}", status_code=202, response_model=W.SandboxReply)
def delete(sandbox_id: str, request: Request, master: MasterDep, caller: Caller) -> W.SandboxReply:
    request.state.tenant = owned(master, caller, sandbox_id).tenant
    return sandbox_record(master.delete(sandbox_id), W.SandboxReply)


@router.put("/v1/nodes/{node}/sandboxes/{sandbox_id}/status", response_model=W.StatusReply)
def sandbox_status(node: str, sandbox_id: str, body: W.StatusBody, master: MasterDep) -> W.StatusReply:
    """Cubelet's push: the sandbox is ready (guest validated), or failed with code and layer."""
    if (body.phase == "failed") != (body.error is not None) or (body.phase == "failed" and body.workload):
        raise CubeError(
            "api.invalid_request", "a failed status carries an error (no workload); a running one does not", "api"
        )
    error = None if body.error is None else sandbox_error(body.error)
    return W.StatusReply(state=master.node_status(node, sandbox_id, body.phase, error, body.workload))
