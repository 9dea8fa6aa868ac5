"""A shim report's details are built from its kind's model (wire/reports.py): the JSON the shim sends (POST body,
`undelivered.jsonl` line) is what the keyword arguments it replaced encoded to, byte for byte; a typo'd or
mis-typed detail is refused where it is built; the Cubelet reads the same model leniently."""

from __future__ import annotations

import json
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from cubeaccel.model.bars import Bar, BarKind
from cubeaccel.protocol.reports import ShimReport, ShimReportKind
from cubeaccel.shim.reporter import Reporter
from cubeaccel.wire import reports as R
from cubeaccel.wire.reports import ReportDetails, parse_report, report_json

K = ShimReportKind
MODELS: tuple[type[ReportDetails], ...] = (
    R.VmStarted,
    R.VmmConfined,
    R.MemoryPinned,
    R.GuestReady,
    R.WorkloadReady,
    R.WorkloadUnresponsive,
    R.WorkloadRecovered,
    R.DeviceAttached,
    R.AttachFailed,
    R.GuestValidationFailed,
    R.GuestValidated,
    R.DeviceDetached,
    R.DetachTimeout,
    R.VmmExited,
    R.ShimExiting,
    R.WarmClaimed,
    R.ScrubFinished,
)
GUEST_REPORT = {"agent_version": 1, "kernel_release": "6.1.0", "modules_loaded": ["nvidia"], "cuda": None}
# What the shim's call sites (shim/process.py) passed as keyword arguments, per kind, in their order.
SENT: list[tuple[ShimReportKind, dict[str, Any]]] = [
    (
        K.VM_STARTED,
        {
            "pid": 4242,
            "vmm": "qemu",
            "accel": "kvm",
            "accel_reason": None,
            "start": "template",
            "cold_reason": None,
            "image_digest": "sha256:ab",
            "kernel_release": "6.1.0",
            "image_mismatches": [{"code": "compat.x", "expected": "1", "found": "2", "layer": "guest_kernel"}],
            "uid": 100123,
        },
    ),
    (K.VM_STARTED, {"pid": 40000, "vmm": "simulated", "image_digest": None}),  # the simulated node's
    (
        K.VMM_CONFINED,
        {
            "pid": 4242,
            "uid": 100123,
            "gid": 100123,
            "groups": [],
            "capeff": "0000000000004000",
            "no_new_privs": 1,
            "seccomp": 2,
            "mnt_ns": "mnt:[4026532]",
            "memlock_mode": "rlimit",
            "exposed": ["/usr", "/dev/kvm"],
            "handed_over": [],
        },
    ),
    (K.MEMORY_PINNED, {"vmlck_kib": 1048576, "vmrss_kib": 1050000, "guest_kib": 1048576, "guest_ram_locked_kib": 1}),
    (K.GUEST_READY, {"agent": {"version": 1, "methods": ["probe", "wait_pci"], "pci_addresses": ["0000:00:01.0"]}}),
    (K.GUEST_READY, {}),
    (K.WORKLOAD_READY, {"health_ms": 12.5, "socket": "workload.sock"}),
    (K.WORKLOAD_UNRESPONSIVE, {"reason": "workload.unresponsive", "message": "no answer for 20 s"}),
    (K.WORKLOAD_RECOVERED, {"message": "answering again after 31.0 s (0.2 s)"}),
    (
        K.DEVICE_ATTACHED,
        {
            "qdev_id": "accel0",
            "bus": "rp0",
            "guest_address": "0000:01:00.0",
            "vendor_device": "10de:2330",
            "bars": [{"index": 0, "size": 16777216, "kind": "mem64", "prefetch": True}],
            "guest_bars": [{"bar": "BAR0", "start": "0xfe000000", "size": 16777216}],
            "hotplug_ms": 81.3,
        },
    ),
    (
        K.ATTACH_FAILED,
        {
            "reason": "compat.guest_kernel_mismatch",
            "layer": "guest_kernel",
            "message": "guest image does not match",
            "mismatches": [{"code": "compat.x", "expected": "1", "found": "2", "layer": "guest_kernel"}],
        },
    ),
    (K.ATTACH_FAILED, {"reason": "guest.validation_failed", "layer": "x", "message": "m", "failed_layers": "junk"}),
    (K.ATTACH_FAILED, {"reason": "shim.internal_error", "layer": "cubelet", "message": "KeyError: 'x'"}),
    (K.GUEST_VALIDATION_FAILED, {"reason": "agent.timeout", "layer": "agent", "message": "no answer"}),
    (
        K.GUEST_VALIDATION_FAILED,
        {"report": GUEST_REPORT, "violations": [{"layer": "kernel_driver"}], "failed_layers": ["kernel_driver"]},
    ),
    (K.GUEST_VALIDATION_FAILED, {"report": None, "violations": "a guest's", "failed_layers": {"not": "a list"}}),
    (K.GUEST_VALIDATED, {"report": GUEST_REPORT}),
    (K.GUEST_VALIDATED, {"report": None}),
    (K.DEVICE_DETACHED, {"qdev_id": "accel0", "detach_ms": 3.2}),
    (K.DETACH_TIMEOUT, {"qdev_id": "accel0", "reason": "qmp.error", "message": "device_del refused"}),
    (K.DETACH_TIMEOUT, {"qdev_id": "accel0", "timeout_s": 10.0}),
    (K.VMM_EXITED, {"pid": 4242, "status": 9, "exit_code": None, "signal": 9, "how": "sigkill"}),
    (
        K.SHIM_EXITING,
        {
            "reason": "stop_requested",
            "exit_code": 0,
            "timeline": {"vmm_start_s": 0.1234, "boot_to_agent_s": 1.5},
            "vmm_exit": {"pid": 4242, "status": 0, "exit_code": 0, "signal": None, "how": "quit"},
        },
    ),
    (K.SHIM_EXITING, {"reason": "shim.internal_error", "exit_code": 1, "timeline": {}, "vmm_exit": None}),
    (K.WARM_CLAIMED, {"claimed_as": "sb-2", "reseed": {"mixed": True, "credited_bits": 256, "why_not": None}}),
    (K.WARM_CLAIMED, {"claimed_as": "sb-2", "reseed": None}),
    (
        K.SCRUB_FINISHED,
        {"result": {"ok": True, "method": "cuda", "bytes": 1 << 34}, "evidence": {"zeroed": 1}, "image_digest": "d"},
    ),
]
MODEL_OF = {K.ATTACH_FAILED: R.AttachFailed} | {m.kind: m for m in MODELS if m is not R.AttachFailed}


def _old_line(kind: ShimReportKind, details: dict[str, Any], at: float = 1.5) -> str:
    """The line (and POST body) the keyword-argument reporter wrote for these details."""
    return json.dumps(report_json(ShimReport("sb-1", kind, ("d1",), details, at, "st-1")))


def _new_line(model: ReportDetails, at: float = 1.5) -> str:
    return json.dumps(report_json(ShimReport("sb-1", model.kind, ("d1",), model.to_json(), at, "st-1")))


def test_every_kind_has_its_model() -> None:
    assert set(MODEL_OF) == set(ShimReportKind)
    assert {kind for kind, _ in SENT} == set(ShimReportKind)


@pytest.mark.parametrize(("kind", "details"), SENT, ids=[f"{k.value}-{i}" for i, (k, _) in enumerate(SENT)])
def test_the_models_line_is_the_keyword_arguments_line(kind: ShimReportKind, details: dict[str, Any]) -> None:
    assert _new_line(MODEL_OF[kind](**details)) == _old_line(kind, details)


@pytest.mark.parametrize(("kind", "details"), SENT[:3], ids=["vm_started", "vm_started_sim", "vmm_confined"])
def test_the_reporters_undelivered_line_is_byte_identical(
    kind: ShimReportKind, details: dict[str, Any], tmp_path: Path
) -> None:
    r = Reporter("sb-1", tmp_path / "nobody.sock", None, tmp_path, retries=1, start_id="st-1")
    r.report(MODEL_OF[kind](**details), ("d1",))
    line = (tmp_path / "undelivered.jsonl").read_text()
    assert line == _old_line(kind, details, at=json.loads(line)["at"]) + "\n"


def test_the_shims_own_values_encode_as_their_json_did() -> None:
    """The shim passes its BARs and its VMM's exit as they are; the keyword path passed their JSON."""
    bars = (Bar(0, 1 << 24, BarKind.MEM64, True), Bar(2, 1 << 12, BarKind.MEM32))
    placed = R.PlacedBar(bar="BAR0", start="0xfe000000", size=1 << 24)
    new = R.DeviceAttached(qdev_id="accel0", bars=bars, guest_bars=[placed], hotplug_ms=1.0)
    old = {
        "qdev_id": "accel0",
        "bars": [b.to_json() for b in bars],
        "guest_bars": [placed.model_dump()],
        "hotplug_ms": 1.0,
    }
    assert _new_line(new) == _old_line(K.DEVICE_ATTACHED, old)
    exit_ = R.VmmExited(pid=7, status=0, exit_code=0, signal=None, how="quit")
    old_exit = {"pid": 7, "status": 0, "exit_code": 0, "signal": None, "how": "quit"}
    new_exiting = R.ShimExiting(reason="stop_requested", exit_code=0, timeline={}, vmm_exit=exit_)
    old_exiting = {"reason": "stop_requested", "exit_code": 0, "timeline": {}, "vmm_exit": old_exit}
    assert _new_line(new_exiting) == _old_line(K.SHIM_EXITING, old_exiting)


def test_a_typo_or_a_wrong_type_is_refused_where_the_details_are_built() -> None:
    with pytest.raises(ValidationError):
        R.VmStarted(pdi=1)  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        R.VmStarted(pid="4242")  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        R.ShimExiting(exit_code=0, timeline={"boot_s": "slow"})  # type: ignore[dict-item]
    with pytest.raises(ValidationError):
        R.DeviceDetached(qdev_id="accel0", detach_s=1.0)  # type: ignore[call-arg]


def test_relayed_guest_values_are_sent_as_the_guest_said_them() -> None:
    sent = R.GuestValidationFailed(report=None, violations="a guest's", failed_layers={"not": "a list"})  # type: ignore[arg-type]
    assert sent.to_json() == {"report": None, "violations": "a guest's", "failed_layers": {"not": "a list"}}


def test_the_cubelet_reads_what_it_cannot_use_as_absent() -> None:
    assert R.VmStarted.read({"pid": "4242", "vmm": 5, "accel": "kvm", "newer": 1}) == R.VmStarted(accel="kvm")
    assert R.VmStarted.read({"pid": 1 << 22}).pid is None and R.VmStarted.read({"pid": True}).pid is None
    failed = R.StartFailed.read({"reason": 17, "layer": "", "failed_layers": "junk", "report": [1], "x": {}})
    assert (failed.reason, failed.layer, failed.failed_layers, failed.report) == ("17", None, None, None)
    confined = R.VmmConfined.read({"pid": "4242", "uid": [0], "gid": 1})
    assert (confined.pid, confined.uid) == ("4242", [0])  # as sent: compared with the Cubelet's own reading


# ---- Hypothesis: any details of the declared types encode as the keyword arguments did, and read back -------
_INT64 = st.integers(-(2**63), 2**63 - 1)
_FLOAT = st.floats(allow_nan=False, allow_infinity=False)
_JSON = st.recursive(
    st.none() | st.booleans() | _INT64 | _FLOAT | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


def _strategy(annotation: Any) -> st.SearchStrategy[Any]:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _strategy(args[0])
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(_strategy(a) for a in args))
    if origin is typing.Literal:
        return st.sampled_from(args)
    if origin is list:
        return st.lists(_strategy(args[0]), max_size=3)
    if origin is dict:
        return st.dictionaries(st.text(max_size=6), _strategy(args[1]), max_size=3)
    if origin is tuple:
        return st.lists(_strategy(args[0]), max_size=3)
    if annotation is Bar:  # as the shim sent them: each BAR's own JSON
        kinds = st.sampled_from(BarKind)
        sizes = st.integers(0, 48).map(lambda e: 1 << e)
        return st.builds(Bar, st.integers(0, 5), sizes, kinds, st.booleans()).map(Bar.to_json)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return _details(annotation)
    simple: dict[Any, st.SearchStrategy[Any]] = {
        type(None): st.none(),
        int: _INT64,
        float: _FLOAT,
        str: st.text(min_size=1, max_size=10),
        typing.Any: _JSON,
    }
    return simple[annotation]


def _details(model: type[BaseModel]) -> st.SearchStrategy[dict[str, Any]]:
    """Keyword arguments as a sending site passes them: any subset of the optional fields, in the model's order."""
    fields = {name: _strategy(f.annotation) for name, f in model.model_fields.items()}
    if model is R.VmStarted:
        fields["pid"] = st.none() | st.integers(1, (1 << 22) - 1)

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        required = {n for n, f in model.model_fields.items() if f.is_required()}
        return {name: draw(s) for name, s in fields.items() if name in required or draw(st.booleans())}

    return build()


@pytest.mark.parametrize("model", MODELS, ids=[m.__name__ for m in MODELS])
@given(data=st.data())
def test_any_details_encode_as_before_and_read_back(model: type[ReportDetails], data: st.DataObject) -> None:
    details = data.draw(_details(model))
    sent = model(**details)
    line = _new_line(sent)
    assert line == _old_line(model.kind, details)
    got = parse_report(json.loads(line))
    assert (got.kind, got.details) == (model.kind, details)
    read = model.read(got.details).model_dump(mode="json", exclude_unset=True)
    assert read == {n: _as_read(model, n, details) for n in details if n in model.model_fields}


def _as_read(model: type[ReportDetails], name: str, details: dict[str, Any]) -> Any:
    """What the reading face gives for a field: absent is None, and so is an empty reason, layer or message."""
    value = details.get(name)
    if issubclass(model, R.StartFailed) and name in ("reason", "layer", "message"):
        return value or None
    return value
