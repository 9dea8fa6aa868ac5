"""A node's credential: enrolled (its token, shown once) and revoked by an admin: `/v1/nodes/{node}/credential`.

Included before `nodes.router`: its `POST /v1/nodes/{node}/{verb}` would otherwise take `credential` as a verb.
"""

from __future__ import annotations

from fastapi import APIRouter

from cubeaccel.master.api.deps import AuthDep
from cubeaccel.wire import master_api as W

router = APIRouter()


@router.post("/v1/nodes/{node}/credential", status_code=201, response_model=W.NodeCredential)
def enrol(node: str, auth: AuthDep) -> W.NodeCredential:
    return W.NodeCredential(node=node, token=auth.enrol_node(node))


@router.delete("/v1/nodes/{node}/credential", response_model=W.Revoked)
def revoke_node(node: str, auth: AuthDep) -> W.Revoked:
    auth.revoke_node(node)
    return W.Revoked(revoked=node)
