"""Shim → Cubelet reports on the wire: `POST /v1/shim-reports` bodies and `undelivered.jsonl` lines.

`protocol.reports.ShimReport` stays the value Cubelet reasons about; this is its JSON form. Unknown fields are
ignored as they always were (a newer shim may say more); an unknown version is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    StrictStr,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
)

from cubeaccel.protocol.reports import ShimReport, ShimReportKind
from cubeaccel.wire.base import Finite, LenientMessage
from cubeaccel.wire.json_guard import INT64, check_value
from cubeaccel.wire.shim_spec import Bars
from cubeaccel.wire.snapshot import SnapshotLookup


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


# ---- a report's details, per kind -------------------------------------------------------------------------
# One model per kind is both faces of its details. The shim builds it (`VmStarted(pid=...)`): fields typed, unknown
# names refused, so a typo is a mypy error at the sending site and a ValidationError at run time. The Cubelet reads
# it (`VmStarted.read(report.details)`): what the shim sends relays what the guest said, so a field it cannot use
# reads as absent (None), never as a refused report, and fields it does not know are history (the event trail
# keeps the details as sent). A field the shim did not set stays out of the JSON, as a keyword it did not pass did.

PID_LIMIT = 1 << 22  # the kernel's pid_max ceiling: a larger "pid" from a guest is no process
_READING = {"reading": True}


def _reading(info: ValidationInfo) -> bool:
    return bool(info.context and info.context.get("reading"))


def _text(value: Any, info: ValidationInfo) -> Any:
    """Read: a reason, layer or message as the shim gave it, in words; empty is absent."""
    if not _reading(info):
        return value
    return str(value) if value else None


def _relayed(value: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo) -> Any:
    """Sent: what the guest said, as it said it (the shim relays; the Cubelet judges). Read: of the field's type."""
    return handler(value) if _reading(info) else value


Pid = Annotated[int | None, Field(strict=True, gt=0, lt=PID_LIMIT)]
Text = Annotated[str | None, BeforeValidator(_text)]


def _as_is(value: Any) -> Any:
    return value


_RELAYED = (WrapValidator(_relayed), PlainSerializer(_as_is, return_type=Any))
RelayedObject = Annotated[dict[str, Any] | None, *_RELAYED]
RelayedList = Annotated[list[Any] | None, *_RELAYED]


class ReportDetails(BaseModel):
    """A kind's details; `kind` says which report carries them."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: ClassVar[ShimReportKind]

    @classmethod
    def read(cls, details: Mapping[str, Any]) -> Self:
        """As the Cubelet reads them: unknown fields ignored, a field of the wrong shape absent."""
        known = {k: v for k, v in details.items() if k in cls.model_fields}
        try:
            return cls.model_validate(known, context=_READING)
        except ValidationError as e:
            bad = {err["loc"][0] for err in e.errors() if err["loc"]}
            return cls.model_validate({k: v for k, v in known.items() if k not in bad}, context=_READING)

    def to_json(self) -> dict[str, Any]:
        """The details as sent: the fields the shim set, in the model's order, then any of `extra="allow"`."""
        return self.model_dump(mode="json", exclude_unset=True)


class VmStarted(ReportDetails):
    kind = ShimReportKind.VM_STARTED
    pid: Pid = None  # the VMM the shim started (its identity is then read from /proc, not taken from here)
    vmm: str | None = None
    accel: str | None = None  # tcg or kvm
    accel_reason: str | None = None
    start: Literal["cold", "template"] | None = None
    cold_reason: str | None = None
    snapshot: SnapshotLookup | None = None  # a template start's lookup: the state it restored, or why none matched
    image_digest: str | None = None
    kernel_release: str | None = None
    image_mismatches: list[dict[str, str]] | None = None
    uid: int | None = None


class VmmConfined(ReportDetails):
    """What the shim read of its VMM in /proc (the rest of /proc's fields, its memlock mode and what the VMM was
    shown, as extra fields); the Cubelet reads /proc itself, the pid and uid are only what it checks against."""

    model_config = ConfigDict(extra="allow")
    kind = ShimReportKind.VMM_CONFINED
    pid: Any = None  # compared with the pid of `vm_started`, as sent
    uid: Any = None  # the uid the shim says the VMM runs as, as sent; /proc has the last word


class MemoryPinned(ReportDetails):
    kind = ShimReportKind.MEMORY_PINNED
    vmlck_kib: int | None = None
    vmrss_kib: int | None = None
    guest_kib: int | None = None
    guest_ram_locked_kib: int | None = None


class GuestReady(ReportDetails):
    kind = ShimReportKind.GUEST_READY
    agent: RelayedObject = None  # cube-agent's hello


class WorkloadReady(ReportDetails):
    kind = ShimReportKind.WORKLOAD_READY
    health_ms: float | None = None
    socket: str | None = None


class WorkloadUnresponsive(ReportDetails):
    """The workload service stopped answering on its channel (its PINGs unanswered): the tenant's calls fail with
    `reason` at once instead of waiting, until `workload_recovered`."""

    kind = ShimReportKind.WORKLOAD_UNRESPONSIVE
    reason: Text = None
    message: Text = None


class WorkloadRecovered(ReportDetails):
    kind = ShimReportKind.WORKLOAD_RECOVERED
    message: Text = None


class PlacedBar(BaseModel):
    """A memory BAR where the guest placed it, read from its `resource`."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    bar: str  # "BAR0"
    start: str  # hex, "0x..."
    size: int


class DeviceAttached(ReportDetails):
    kind = ShimReportKind.DEVICE_ATTACHED
    qdev_id: str | None = None
    bus: str | None = None
    guest_address: str | None = None  # where the guest sees the device
    vendor_device: str | None = None
    bars: Bars | None = None  # the device's memory BARs, as discovery recorded them
    guest_bars: list[PlacedBar] | None = None
    hotplug_ms: float | None = None


class StartFailed(ReportDetails):
    """What the Cubelet reads of `attach_failed` and `guest_validation_failed`: the shim's reason, layer and
    message; the latter may carry the guest's report and the layers it failed."""

    kind = ShimReportKind.ATTACH_FAILED
    reason: Text = None
    layer: Text = None
    message: Text = None
    report: RelayedObject = None
    violations: RelayedList = None
    failed_layers: RelayedList = None


class AttachFailed(StartFailed):
    """Sent when a start step failed: the error's own details follow as extra fields."""

    model_config = ConfigDict(extra="allow")


class GuestValidationFailed(StartFailed):
    kind = ShimReportKind.GUEST_VALIDATION_FAILED


class GuestValidated(ReportDetails):
    kind = ShimReportKind.GUEST_VALIDATED
    report: RelayedObject = None  # the agent's GuestReport as JSON, judged again by the Cubelet


class DeviceDetached(ReportDetails):
    kind = ShimReportKind.DEVICE_DETACHED
    qdev_id: str | None = None
    detach_ms: float | None = None


class DetachTimeout(ReportDetails):
    kind = ShimReportKind.DETACH_TIMEOUT
    qdev_id: str | None = None
    reason: str | None = None  # device_del itself was refused
    message: str | None = None
    timeout_s: float | None = None  # no DEVICE_DELETED within it


class VmmExited(ReportDetails):
    kind = ShimReportKind.VMM_EXITED
    pid: int | None = None
    status: int | None = None  # the raw wait status
    exit_code: int | None = None
    signal: int | None = None
    how: str | None = None  # exited, quit, sigterm, sigkill


class ShimExiting(ReportDetails):
    kind = ShimReportKind.SHIM_EXITING
    reason: str | None = None
    exit_code: int | None = None
    timeline: dict[str, float] | None = None
    vmm_exit: VmmExited | None = None


class WarmClaimed(ReportDetails):
    kind = ShimReportKind.WARM_CLAIMED
    claimed_as: str | None = None
    reseed: RelayedObject = None  # what the guest says it did with the claim's seed


class ScrubFinished(ReportDetails):
    kind = ShimReportKind.SCRUB_FINISHED
    result: RelayedObject = None  # the agent's ScrubResult
    evidence: dict[str, Any] | None = None
    image_digest: str | None = None
