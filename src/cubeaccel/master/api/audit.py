"""The audit logs' sealed heads: `/v1/audit/seals` (the rows themselves are written by `access.RequestAudit`)."""

from __future__ import annotations

from fastapi import APIRouter

from cubeaccel.master.api.deps import MasterDep
from cubeaccel.master.auth import audit_seals
from cubeaccel.wire import master_api as W

router = APIRouter()


@router.get("/v1/audit/seals", response_model=W.AuditSeals)
def seals(master: MasterDep) -> W.AuditSeals:
    """Each audit log's sealed head (`cubeaccel audit --verify --master-seal`: a cut-off tail shows)."""
    return W.AuditSeals(seals=[W.AuditSeal.model_validate(s) for s in audit_seals(master.store)])
