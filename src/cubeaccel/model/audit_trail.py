"""Who had which device: the audit actions a device's lifecycle is recorded under, and the question asked of them.

The Cubelet writes one hash-chained audit entry per step of a device's life (`cubelet/device_audit.py`): its
assignment to a sandbox of a tenant (template, contract digest), a warm sandbox's claim (the same, for the
claimer), attach, detach, VMM exit, reset, scrub, release, quarantine and recovery. `holding_at` answers from
those entries which tenant (and sandbox) held a device at a given time. Pure: entries are the log's decoded
JSON lines, in order.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from cubeaccel.model.states import DeviceEvent

E = DeviceEvent

# Each device transition's audit action. Past tense: what happened to the device, told apart from the requests
# that asked for it (`device:assign`, `device:quarantine`, … are the HTTP requests' actions).
DEVICE_ACTIONS: dict[DeviceEvent, str] = {
    E.VALIDATED: "device:validated",
    E.HOST_NOT_READY: "device:host_not_ready",
    E.RESERVE: "device:assigned",
    E.PREPARE: "device:prepared",
    E.ATTACH_SUCCEEDED: "device:attached",
    E.STARTUP_FAILED: "device:teardown",
    E.ATTACH_FAILED: "device:teardown",
    E.TEARDOWN: "device:teardown",
    E.RELEASE_CONFIRMED: "device:released",
    E.REVALIDATED: "device:allocatable",
    E.HEALTH_FAILED: "device:unhealthy",
    E.QUARANTINE: "device:quarantined",
    E.RECOVER: "device:recovered",
    E.RECOVER_SCRUB: "device:recovered_to_scrub",
    E.RETRY: "device:retried",
    E.DISABLE: "device:disabled",
    E.ENABLE: "device:enabled",
}
# Entries that are not transitions (the journal's other events about a device or its sandbox's VMM).
RESET = "device:reset"  # the backend's reset (FLR, …) done as part of a release or after a scrub
DETACHED = "device:detached"  # the shim saw the VMM let go of the sandbox's device(s)
VMM_EXITED = "vmm:exited"  # the sandbox's VMM process was waited for
SCRUB_STARTED = "device:scrub_started"
SCRUBBED = "device:scrubbed"  # outcome ok or failed; the scrub's evidence (docs/scrub.md)
RETRY_ATTEMPT = "device:retry_attempt"  # reconcile's automatic retry of a transient quarantine: its probe
# A warm sandbox's device handed to the create that claimed it: the node's holding (no tenant) ends and the
# claimer's begins at that instant, naming the tenant and the sandbox id the tenant sees (`warm_id`: the one before).
CLAIMED = "device:claimed"
# A tenant stops holding a device when its release is confirmed (VMM gone, no holder, reset) or the device is
# handed back or parked by someone else; a quarantine does not end it (the release was never proven).
_ENDS_HOLDING = {
    DEVICE_ACTIONS[e]
    for e in (E.RELEASE_CONFIRMED, E.REVALIDATED, E.RECOVER, E.RECOVER_SCRUB, E.RETRY, E.DISABLE, E.ENABLE)
}


@dataclass
class Holding:
    """One tenant's time with one device: from its assignment until its release was confirmed (or never)."""

    device: str
    sandbox: str | None
    tenant: str | None
    template: str | None
    contract_digest: str | None
    assigned_at: float
    released_at: float | None = None
    trail: list[dict[str, Any]] = field(default_factory=list)  # the entries of the device and its sandbox meanwhile

    def covers(self, at: float) -> bool:
        return self.assigned_at <= at and (self.released_at is None or at < self.released_at)

    def to_json(self) -> dict[str, object]:
        return dict(self.__dict__)


def holdings(entries: Iterable[dict[str, Any]], device: str) -> list[Holding]:
    """Every holding of `device`, oldest first, each with its trail."""
    out: list[Holding] = []
    current: Holding | None = None
    for e in entries:
        names_device = e.get("device") == device
        if names_device and e.get("action") == CLAIMED and current is not None and current.released_at is None:
            current.trail.append(e)
            current.released_at = float(e.get("at") or 0.0)
        if names_device and e.get("action") in (DEVICE_ACTIONS[E.RESERVE], CLAIMED):
            current = Holding(
                device,
                _str(e.get("sandbox")),
                _str(e.get("tenant")),
                _str(e.get("template")),
                _str(e.get("contract_digest")),
                float(e.get("at") or 0.0),
            )
            out.append(current)
        if current is None:
            continue
        open_ = current.released_at is None
        if open_ and (names_device or (current.sandbox is not None and e.get("sandbox") == current.sandbox)):
            current.trail.append(e)
        if open_ and names_device and e.get("action") in _ENDS_HOLDING:
            current.released_at = float(e.get("at") or 0.0)
    return out


def holding_at(entries: Iterable[dict[str, Any]], device: str, at: float) -> dict[str, Any]:
    """Who held `device` at `at`: `holder` (None when nobody did) and `previous` (the newest holding that ended
    before `at`, None when none did)."""
    found = [h for h in holdings(entries, device) if h.assigned_at <= at]
    holder = next((h for h in reversed(found) if h.covers(at)), None)
    previous = next((h for h in reversed(found) if h is not holder and not h.covers(at)), None)
    return {
        "device": device,
        "at": at,
        "holder": None if holder is None else holder.to_json(),
        "previous": None if previous is None else previous.to_json(),
    }


def _str(v: Any) -> str | None:
    return v if isinstance(v, str) else None
