"""Between tenants, never unsanitized: a checker over a device's event trail (NVIDIA's cloud validation check
SEC21-05: a device is not handed to the next tenant without its memory sanitized).

Walking one device's journal in order, a device is *tainted* from its assignment to a sandbox (`reserve`) until a
sanitizing stage is recorded: a `scrub_finished` that passed, or a `release_confirmed` whose evidence says the
class's scrub policy is `none` (the operator's informed choice, recorded as such) or that no VMM ever started
for the tenant (nothing could have touched the device), or a `retry` back to `released` under policy `none`. An
operator's own transition (`recover`, `disable`/`enable`, audited with who and why) is the operator's decision
and ends the taint too: the operator vouches for the device (docs/scrub.md) — except `recover_scrub`, the
operator's return of a device whose scrub is still owed, which leaves the taint to the scrub that follows. A tainted
device reaching `allocatable` is a violation. Pure: the trail is the store's events as JSON (`Event.to_json()`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from cubeaccel.model.event_kinds import EventKind

ALLOCATABLE = "allocatable"
RECOVER_SCRUB = "recover_scrub"  # model/states.DeviceEvent.RECOVER_SCRUB: this module stays free of the tables


def _sanitizes(e: Mapping[str, Any]) -> str | None:
    """The sanitizing stage this event records, if it is one."""
    kind, event, details = e.get("kind"), e.get("event"), e.get("details") or {}
    if kind == EventKind.SCRUB_FINISHED and details.get("ok") is True:
        return "scrub"
    if kind != EventKind.TRANSITION:
        return None
    if e.get("actor") == "operator":
        return None if event == RECOVER_SCRUB else f"operator:{event}"
    if event == "release_confirmed" and details.get("scrub_policy") == "none":
        return "policy:none"
    if (
        event in ("release_confirmed", "retry")
        and details.get("scrub_method") == "vmm-exit"
        and details.get("scrub_policy") == "trusted-vm"
    ):
        return "vmm_exit"  # the registry's method for a kind whose state ends with its VMM (backends/scrub_methods.py)
    if event == "release_confirmed" and details.get("vmm_started") is False:
        return "never_started"
    if event == "retry" and details.get("scrub_policy") == "none":
        return "policy:none"
    return None


def unsanitized_returns(trail: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Every point where the device went from a tenant to `allocatable` with no sanitizing stage in between."""
    return _walk(trail)[0]


def leftover_tenant(trail: Iterable[Mapping[str, Any]]) -> str | None:
    """The sandbox whose leftovers the device may still hold at the trail's end (None: sanitized since, or never
    assigned). An operator's `recover` asks this to decide whether the scrub is still owed."""
    return _walk(trail)[1]


def _walk(trail: Iterable[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], str | None]:
    tenant: str | None = None  # the sandbox whose leftovers the device may hold
    tainted = False
    out: list[dict[str, Any]] = []
    for e in trail:
        if e.get("kind") == "transition" and e.get("event") == "reserve":
            tenant, tainted = e.get("sandbox_id"), True
            continue
        if _sanitizes(e) is not None:
            tainted = False
            continue
        if tainted and e.get("kind") == "transition" and e.get("to_state") == ALLOCATABLE:
            out.append(
                {"seq": e.get("seq"), "device_id": e.get("device_id"), "tenant": tenant, "event": e.get("event")}
            )
            tainted = False  # reported once; a later tenant starts its own taint
    return out, (tenant if tainted else None)
