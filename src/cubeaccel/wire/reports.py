"""Shim → Cubelet reports on the wire: `POST /v1/shim-reports` bodies and `undelivered.jsonl` lines.

`model.reports.ShimReport` stays the value Cubelet reasons about; this is its JSON form. Unknown fields are
ignored as they always were (a newer shim may say more); an unknown version is refused.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    BeforeValidator,
    Field,
    StrictStr,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
)

from cubeaccel.model.reports import ShimReport, ShimReportKind
from cubeaccel.wire.base import Finite, Lenient, LenientMessage
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


# ---- what the Cubelet reads of a report's details, per kind --------------------------------------------------
# The details come from the shim, which relays what the guest said: the event trail keeps them as sent, and a
# field the Cubelet cannot use is read as absent (None), never as a refused report. Unknown fields are history.

PID_LIMIT = 1 << 22  # the kernel's pid_max ceiling: a larger "pid" from a guest is no process


def _or_none(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    try:
        return handler(value)
    except ValidationError:
        return None


def _text(value: Any) -> str | None:
    """A reason, layer or message as the shim gave it, in words; empty is absent."""
    return str(value) if value else None


Pid = Annotated[int | None, Field(strict=True, gt=0, lt=PID_LIMIT), WrapValidator(_or_none)]
Text = Annotated[str | None, BeforeValidator(_text)]
OptStr = Annotated[StrictStr | None, WrapValidator(_or_none)]
OptObject = Annotated[dict[str, Any] | None, WrapValidator(_or_none)]
OptList = Annotated[list[Any] | None, WrapValidator(_or_none)]


class VmStarted(Lenient):
    pid: Pid = None  # the VMM the shim started (its identity is then read from /proc, not taken from here)


class VmmConfined(Lenient):
    pid: Any = None  # compared with the pid of `vm_started`, as sent
    uid: Any = None  # the uid the shim says the VMM runs as; /proc has the last word


class DeviceAttached(Lenient):
    guest_address: OptStr = None  # where the guest sees the device


class StartFailed(Lenient):
    """`attach_failed` and `guest_validation_failed`: the shim's reason, layer and message; the latter may carry
    the guest's report and the layers it failed."""

    reason: Text = None
    layer: Text = None
    message: Text = None
    failed_layers: OptList = None
    report: OptObject = None


class GuestValidated(Lenient):
    report: OptObject = None  # the agent's GuestReport as JSON, judged again by the Cubelet
