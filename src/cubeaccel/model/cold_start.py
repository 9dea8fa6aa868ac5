"""A sandbox's cold-start timeline from its event trail: the phases the metrics and the dashboard show.

Milestones in the order a start goes through them; a phase is the time from the previous milestone that
happened to its own. One that did not happen (no pinning asked, no workload service) gives no phase and the
next phase starts from the one before, so the phases always add up to `total`.
"""

from __future__ import annotations

from collections.abc import Iterable

# (phase name, event kind, shim report or transition event, last occurrence counts)
MILESTONES: tuple[tuple[str, str, str | None, bool], ...] = (
    ("reserve", "transition", "prepare", False),  # reservation made → start recorded (revalidated, launching)
    ("vm_start", "shim_report", "vm_started", False),  # VMM spawned or restored from the template snapshot
    ("pin", "shim_report", "memory_pinned", False),  # guest memory proven locked
    ("guest_boot", "shim_report", "guest_ready", False),  # the guest agent said hello
    ("hotplug", "shim_report", "device_attached", True),  # every device hot-plugged and seen by the guest
    ("workload_ready", "shim_report", "workload_ready", False),  # the workload service answered
    ("guest_validation", "shim_report", "guest_validated", False),  # the contract checked inside the guest
    ("ready", "sandbox_running", None, False),  # Cubelet judged the guest report: the sandbox runs
)
PHASES = (*(m[0] for m in MILESTONES), "total")


def cold_start_phases(events: Iterable[tuple[str, str | None, float]]) -> dict[str, float]:
    """`events`: (kind, event, at) of one sandbox, oldest first. Only the latest start counts (a sandbox id
    may be reused): everything before its last `reservation_created` is ignored. Empty until it is running."""
    trail = list(events)
    starts = [i for i, (kind, _, _) in enumerate(trail) if kind == "reservation_created"]
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
