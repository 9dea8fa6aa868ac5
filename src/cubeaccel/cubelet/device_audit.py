"""The node's audit trail of its devices: each step of a device's life, from the journal's events, as entries in
the Cubelet's hash-chained audit log (host/service/audit.py), so the log alone says who had which device
(`cubeaccel audit --device ID --at TIME`, model/audit_trail.py).

A store listener: it sees each change's events once its transaction is in, queues their entries without waiting
for the disk (the lifecycle lock may be held), and `settle()` — called by `Cubelet.change()` once the store's
commit is durable — waits until this thread's entries are on disk too, before anything is replied.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import suppress
from typing import Any

from cubeaccel.cubelet.store import Event
from cubeaccel.host.service.audit import AuditLog
from cubeaccel.model import audit_trail as A
from cubeaccel.model.event_kinds import EventKind
from cubeaccel.model.states import DeviceEvent
from cubeaccel.protocol.reports import ShimReportKind
from cubeaccel.wire.scrub import RESULT_FIELDS

IDENTITY = "cubelet"
# The scrub's evidence as the audit keeps it (the journal keeps the agent's whole result besides).
SCRUB_FIELDS = (
    *RESULT_FIELDS,
    "duration_s",
    "vm_s",
    "image_digest",
    "scrub_vm",
    "message",
    "reset_after",
)
_EVENTS = frozenset(e.value for e in DeviceEvent)
Entry = tuple[str, str, dict[str, Any]]  # action, outcome, fields


def entries_of(ev: Event) -> list[Entry]:
    """The audit entries one journal event makes (none for events that are not about a device's custody)."""
    base: dict[str, Any] = {
        "target": ev.device_id or ev.sandbox_id,
        "device": ev.device_id,
        "sandbox": ev.sandbox_id,
        "by": ev.actor,
    }
    d = ev.details
    if ev.kind == EventKind.TRANSITION and ev.event is not None and ev.event in _EVENTS:
        event = DeviceEvent(ev.event)
        fields = {**base, "from_state": ev.from_state, "to_state": ev.to_state, "reason": ev.reason}
        if isinstance(d.get("who"), str):
            fields["who"] = d["who"]  # an operator's verb: the name it was given
        if event is DeviceEvent.RESERVE:
            fields.update({k: d.get(k) for k in ("tenant", "template", "contract_digest")})
        out: list[Entry] = []
        if event is DeviceEvent.RELEASE_CONFIRMED and d.get("reset") is True:
            out.append((A.RESET, "ok", {**base, "after": "release"}))
        out.append((A.DEVICE_ACTIONS[event], "ok", fields))
        return out
    if ev.kind == EventKind.DEVICE_CLAIMED:  # a warm sandbox's device, from the node to its claimer
        return [
            (A.CLAIMED, "ok", {**base, **{k: d.get(k) for k in ("warm_id", "tenant", "template", "contract_digest")}})
        ]
    if ev.kind == EventKind.SCRUB_STARTED:
        return [(A.SCRUB_STARTED, "ok", {**base, "policy": d.get("policy")})]
    if ev.kind == EventKind.SCRUB_FINISHED:
        fields = {**base, **{k: d[k] for k in SCRUB_FIELDS if k in d}}
        out = [(A.SCRUBBED, "ok" if d.get("ok") is True else "failed", fields)]
        if d.get("ok") is True and d.get("reset_after") == "ok":
            out.append((A.RESET, "ok", {**base, "after": "scrub"}))
        return out
    if ev.kind == EventKind.QUARANTINE_RETRY:
        keys = ("attempt", "limit", "probe", "quarantine_reason", "exhausted")
        return [(A.RETRY_ATTEMPT, "ok" if d.get("ok") is True else "failed", {**base, **{k: d.get(k) for k in keys}})]
    if ev.kind == EventKind.SHIM_REPORT and ev.event == ShimReportKind.DEVICE_DETACHED:
        return [(A.DETACHED, "ok", base)]
    if ev.kind == EventKind.SHIM_REPORT and ev.event == ShimReportKind.VMM_EXITED:
        return [(A.VMM_EXITED, "ok", {**base, "pid": d.get("pid"), "status": d.get("status")})]
    return []


class DeviceAudit:
    """`store.listeners` member: every device custody event becomes an audit entry."""

    def __init__(self, audit: AuditLog, node: str) -> None:
        self.audit = audit
        self.node = node
        self._local = threading.local()

    def __call__(self, events: list[Event]) -> None:
        pending: list[Callable[[], dict[str, Any]]] = self._pending()
        for ev in events:
            for action, outcome, fields in entries_of(ev):
                pending.append(self.audit.append_later(action, IDENTITY, outcome, node=self.node, **fields))

    def _pending(self) -> list[Callable[[], dict[str, Any]]]:
        got: list[Callable[[], dict[str, Any]]] | None = getattr(self._local, "pending", None)
        if got is None:
            got = self._local.pending = []
        return got

    def settle(self) -> None:
        """Wait until the entries this thread queued are on disk (an audit write that failed is not the change's
        failure: the change is already durable; the log's own error surfaces on its next append)."""
        pending = self._pending()
        while pending:
            wait = pending.pop(0)
            with suppress(Exception):
                wait()
