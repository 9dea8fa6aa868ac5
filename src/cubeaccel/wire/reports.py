"""Shim → Cubelet reports on the wire: `POST /v1/shim-reports` bodies and `undelivered.jsonl` lines.

`model.reports.ShimReport` stays the value Cubelet reasons about; this is its JSON form. Unknown fields are
ignored as they always were (a newer shim may say more); an unknown version is refused.
"""

from __future__ import annotations

from typing import Any

from pydantic import StrictStr, field_validator

from cubeaccel.model.reports import ShimReport, ShimReportKind
from cubeaccel.wire.base import Finite, LenientMessage
from cubeaccel.wire.json_guard import INT64, check_value


class ShimReportBody(LenientMessage):
    sandbox_id: StrictStr
    kind: ShimReportKind
    device_ids: tuple[StrictStr, ...] = ()
    details: dict[str, Any] = {}
    at: Finite = 0.0
    start_id: StrictStr | None = None  # which start of the sandbox the shim serves: stale reports are refused

    @field_validator("details")
    @classmethod
    def _bounded(cls, value: dict[str, Any]) -> dict[str, Any]:
        """The details carry what the guest said (its report, pids, sizes): every number finite and within
        64 bits, the nesting bounded, before the judge, the store or `os.kill` sees one."""
        check_value(value, int_bound=INT64)
        return value

    @classmethod
    def of(cls, r: ShimReport) -> ShimReportBody:
        return cls(
            sandbox_id=r.sandbox_id,
            kind=r.kind,
            device_ids=r.device_ids,
            details=r.details,
            at=r.at,
            start_id=r.start_id,
        )

    def report(self) -> ShimReport:
        return ShimReport(self.sandbox_id, self.kind, self.device_ids, dict(self.details), self.at, self.start_id)


def report_json(r: ShimReport) -> dict[str, Any]:
    return ShimReportBody.of(r).model_dump(mode="json")


def parse_report(data: object) -> ShimReport:
    """A report from JSON; a pydantic ValidationError (a ValueError) when it is not one."""
    return ShimReportBody.model_validate(data).report()
