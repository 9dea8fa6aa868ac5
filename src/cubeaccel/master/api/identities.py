"""Who the caller is, tenants and API keys: `/v1/whoami`, `/v1/tenants`, `/v1/admin-keys`, `/v1/keys`."""

from __future__ import annotations

from fastapi import APIRouter, Request

from cubeaccel.master.api.deps import AuthDep, Caller, MasterDep
from cubeaccel.master.auth import ADMIN, TENANT
from cubeaccel.master.records import Quota
from cubeaccel.model.sandbox_states import SandboxActor
from cubeaccel.wire import master_api as W

router = APIRouter()


@router.get("/v1/whoami", response_model=W.WhoAmI)
def whoami(auth: AuthDep, caller: Caller) -> W.WhoAmI:
    prefix = auth.sandbox_prefix(caller.tenant) if caller.role == TENANT and caller.tenant else None
    return W.WhoAmI(
        role=caller.role, tenant=caller.tenant, node=caller.node, key_id=caller.key_id, sandbox_id_prefix=prefix
    )


@router.post("/v1/tenants", status_code=201, response_model=W.TenantCreated)
def create_tenant(body: W.TenantBody, request: Request, auth: AuthDep) -> W.TenantCreated:
    request.state.tenant = body.name
    auth.create_tenant(body.name, Quota.from_json(body.quota.model_dump()))
    kid, key = auth.create_key(TENANT, body.name)
    return W.TenantCreated(name=body.name, key_id=kid, key=key)


@router.get("/v1/tenants", response_model=W.TenantList)
def tenants(auth: AuthDep) -> W.TenantList:
    return W.TenantList(tenants=auth.tenants())


@router.delete("/v1/tenants/{tenant}", response_model=W.Revoked)
def revoke_tenant(tenant: str, request: Request, master: MasterDep) -> W.Revoked:
    request.state.tenant = tenant
    master.auth.revoke_tenant(tenant)
    master.end_revoked({tenant}, SandboxActor.USER)
    return W.Revoked(revoked=tenant)


@router.post("/v1/tenants/{tenant}/keys", status_code=201, response_model=W.KeyCreated)
def create_key(tenant: str, request: Request, auth: AuthDep) -> W.KeyCreated:
    request.state.tenant = tenant
    kid, key = auth.create_key(TENANT, tenant)
    return W.KeyCreated(key_id=kid, key=key, tenant=tenant)


@router.post("/v1/admin-keys", status_code=201, response_model=W.KeyCreated)
def create_admin_key(auth: AuthDep) -> W.KeyCreated:
    kid, key = auth.create_key(ADMIN)
    return W.KeyCreated(key_id=kid, key=key, tenant=None)


@router.post("/v1/keys", status_code=201, response_model=W.KeyCreated)
def create_own_key(request: Request, auth: AuthDep, caller: Caller) -> W.KeyCreated:
    """Rotation without downtime: a second key for the caller's own tenant (an admin: an admin key); both
    work until the old one is revoked."""
    request.state.tenant = caller.tenant
    kid, key = auth.create_key(caller.role, caller.tenant)
    return W.KeyCreated(key_id=kid, key=key, tenant=caller.tenant)


@router.get("/v1/keys", response_model=W.KeyList)
def keys(auth: AuthDep, caller: Caller) -> W.KeyList:
    return W.KeyList(keys=auth.keys(caller.tenant if caller.role == TENANT else None))


@router.delete("/v1/keys/{key_id}", response_model=W.Revoked)
def revoke_key(key_id: str, request: Request, auth: AuthDep, caller: Caller) -> W.Revoked:
    request.state.tenant = caller.tenant
    auth.revoke_key(key_id, caller.tenant if caller.role == TENANT else None)
    return W.Revoked(revoked=key_id)
