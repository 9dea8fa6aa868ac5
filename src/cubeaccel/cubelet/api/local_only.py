"""What only the unix socket serves (root or the Cubelet's own uid): shim reports, which are VM evidence, and an
operator's reconcile. The TCP listener CubeMaster uses never includes this router, so nothing on the network can
forge a report."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from cubeaccel.cubelet.api.deps import CubeletDep
from cubeaccel.cubelet.lifecycle import validate_sandbox_id
from cubeaccel.cubelet.reconcile import reconcile
from cubeaccel.protocol.errors import invalid
from cubeaccel.transport.api_edges import json_body
from cubeaccel.wire import cubelet_api as W
from cubeaccel.wire.reports import parse_report

router = APIRouter()


@router.post("/v1/shim-reports", status_code=202, response_model=W.Accepted, openapi_extra=json_body("ShimReportBody"))
def shim_report(body: dict[str, Any], cubelet: CubeletDep) -> W.Accepted:
    try:
        report = parse_report(body)
    except ValueError as e:
        raise invalid("api.invalid_shim_report", f"invalid shim report: {e}") from e
    validate_sandbox_id(report.sandbox_id)
    cubelet.handle_report(report)
    return W.Accepted(accepted=True)


@router.post("/v1/reconcile", response_model=W.Repairs)
def run_reconcile(cubelet: CubeletDep) -> W.Repairs:
    repairs = reconcile(cubelet)
    return W.Repairs(
        repairs=[W.Repair(device_id=r.device_id, sandbox_id=r.sandbox_id, what=r.what, why=r.why) for r in repairs]
    )
