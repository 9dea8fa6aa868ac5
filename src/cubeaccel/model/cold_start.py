"""A sandbox's cold-start timeline from its event trail: the phases the metrics and the dashboard show.

Milestones in the order a start goes through them; a phase is the time from the previous milestone that
happened to its own. One that did not happen (no pinning asked, no workload service) gives no phase and the
next phase starts from the one before, so the phases always add up to `total`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from cubeaccel.model.event_kinds import EventKind
from cubeaccel.model.states import DeviceEvent
from cubeaccel.protocol.reports import ShimReportKind

# Why a start booted cold instead of restoring its machine shape's template snapshot (error_catalog.py).
COLD_NO_SNAPSHOT = "start.cold_no_snapshot"  # none was prepared for this shape on this node
COLD_POLICY_DEVICES = "start.cold_policy_devices"  # a NIC, scratch disk or mount: not the snapshot's machine
COLD_CONFIGURED = "start.cold_configured"  # the node starts every sandbox cold (`--vm-start cold`)


def cold_start_reason(start: str, policy_devices: bool) -> str | None:
    """Before any lookup: the reason a start will boot cold whatever the node holds, or None (look one up)."""
    if policy_devices:
        return COLD_POLICY_DEVICES
    return COLD_CONFIGURED if start != "template" else None


K, R = EventKind, ShimReportKind
# (phase name, event kind, shim report or transition event, last occurrence counts)
MILESTONES: tuple[tuple[str, EventKind, str | None, bool], ...] = (
    ("reserve", K.TRANSITION, DeviceEvent.PREPARE, False),  # reservation made → start recorded (revalidated, launching)
    ("vm_start", K.SHIM_REPORT, R.VM_STARTED, False),  # VMM spawned or restored from the template snapshot
    ("pin", K.SHIM_REPORT, R.MEMORY_PINNED, False),  # guest memory proven locked
    ("guest_boot", K.SHIM_REPORT, R.GUEST_READY, False),  # the guest agent said hello
    ("hotplug", K.SHIM_REPORT, R.DEVICE_ATTACHED, True),  # every device hot-plugged and seen by the guest
    ("workload_ready", K.SHIM_REPORT, R.WORKLOAD_READY, False),  # the workload service answered
    ("guest_validation", K.SHIM_REPORT, R.GUEST_VALIDATED, False),  # the contract checked inside the guest
    ("ready", K.SANDBOX_RUNNING, None, False),  # Cubelet judged the guest report: the sandbox runs
)
PHASES = (*(m[0] for m in MILESTONES), "total")


def cold_start_phases(events: Iterable[tuple[str, str | None, float]]) -> dict[str, float]:
    """`events`: (kind, event, at) of one sandbox, oldest first. Only the latest start counts (a sandbox id
    may be reused): everything before its last `reservation_created` is ignored. Empty until it is running."""
    trail = list(events)
    starts = [i for i, (kind, _, _) in enumerate(trail) if kind == EventKind.RESERVATION_CREATED]
    if not starts:
        return {}
    trail = trail[starts[-1] :]
    t0 = trail[0][2]
    seen: dict[str, float] = {}
    for name, kind, event, last in MILESTONES:
        hits = [at for k, e, at in trail if k == kind and (event is None or e == event)]
        if hits:
            seen[name] = hits[-1] if last else hits[0]
    if "ready" not in seen:
        return {}
    out: dict[str, float] = {}
    prev = t0
    for name, *_ in MILESTONES:
        if name in seen:
            out[name] = max(0.0, seen[name] - prev)
            prev = seen[name]
    out["total"] = max(0.0, seen["ready"] - t0)
    return out


def start_path(events: Iterable[tuple[str, str | None, Mapping[str, Any]]]) -> dict[str, str | None]:
    """How the latest start brought its VM up: `{"path": "template"|"cold", "reason": code|None}` from its
    `vm_started` report; empty before one. A cold start always names its reason."""
    found: dict[str, str | None] = {}
    for kind, event, details in events:
        if kind == EventKind.RESERVATION_CREATED:
            found = {}
        elif kind == EventKind.SHIM_REPORT and event == ShimReportKind.VM_STARTED:
            path = str(details.get("start") or "cold")
            reason = details.get("cold_reason")
            found = {"path": path, "reason": str(reason) if reason else None}
    return found
