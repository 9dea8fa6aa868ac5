"""Reconcile's bounded retry of transient quarantines (model/recovery.py: which reasons, how often, how many).

Per quarantined device whose reason is transient and whose next attempt is due (or whose reason names a host fact
that is back: the scrub image its scrub VM boots, as this pass's check found it): probe it again on host evidence,
under its lock, with no transaction open — the sandbox's VMM proven gone, no holder of its files, device nodes
taken back, the reset — and record the attempt (`quarantine_retry`, with the probe's result; the audit log gets
it as `device:retry_attempt`). A passing probe moves the device `quarantined → released` (event `retry`); from
there the release path's own steps run as after any release: the scrub where the class's policy asks for one
(a quarantined device may hold what a tenant or a stray holder left), then revalidation. A failing probe leaves
the device quarantined for the next attempt, until the bound; then it waits for an operator.

The attempts of an episode are counted from the journal (since the device was last `allocatable` or an operator
acted), so a restart neither forgets them nor starts the count again.
"""

from __future__ import annotations

from typing import Any

from cubeaccel.cubelet.ports import RetryHost
from cubeaccel.cubelet.release import SCRUB_PENDING
from cubeaccel.cubelet.scrub import ScrubPolicy, scrub_method_name, scrub_needs_vm
from cubeaccel.model.device import DeviceRecord
from cubeaccel.model.event_kinds import EventKind
from cubeaccel.model.recovery import RETRY_LIMIT, Recovery, recovery_of, retry_due
from cubeaccel.model.states import Actor, DeviceEvent, DeviceState

S, E = DeviceState, DeviceEvent
KIND = EventKind.QUARANTINE_RETRY


def history(cubelet: RetryHost, device_id: str) -> tuple[int, float | None]:
    """(attempts so far in this episode, time of the last one)."""
    with cubelet.store.read() as t:
        start = t.c.execute(
            "SELECT COALESCE(MAX(seq), 0) FROM events WHERE device_id=? AND kind='transition' "
            "AND (to_state=? OR actor=?)",
            (device_id, S.ALLOCATABLE.value, Actor.OPERATOR.value),
        ).fetchone()[0]
        n, last = t.c.execute(
            "SELECT COUNT(*), MAX(at) FROM events WHERE device_id=? AND kind=? AND seq>?", (device_id, KIND, start)
        ).fetchone()
    return int(n), (None if last is None else float(last))


def probe(cubelet: RetryHost, d: DeviceRecord) -> list[dict[str, Any]]:
    """What still stands in the way (empty: the device can go back through the release path). Host I/O."""
    res = cubelet.store.reservation(d.sandbox_id) if d.sandbox_id else None
    if res is not None and d.id in res.device_ids and not cubelet.vmm_gone(res, cubelet.vmm_status(res)):
        return [{"code": "release.vmm_not_exited", "message": f"the VMM of {res.sandbox_id} is not proven gone"}]
    holders = cubelet.backend.holders(d)
    if holders:
        code = "release.holder_unknown" if any(h.unknown for h in holders) else "release.holder_stuck"
        return [{"code": code, "message": f"{len(holders)} holder(s)", "holders": [h.__dict__ for h in holders]}]
    nodes = cubelet.capabilities.nodes
    # the reset ladder with the journal's claims, as at release; a retry follows a clean settle, not a killed VMM
    problems = (nodes.reclaim_nodes(d) if nodes is not None else []) or cubelet.reset_device(d, unclean=False)[0]
    return [{"code": p.code, "message": p.message} for p in problems]


def retry_quarantined(cubelet: RetryHost) -> list[tuple[str, str, bool]]:
    """One pass: (device id, its quarantine reason, probe passed) for every attempt made."""
    made: list[tuple[str, str, bool]] = []
    now = float(cubelet.store.clock())
    for d in cubelet.store.devices():
        if d.state is not S.QUARANTINED or recovery_of(d.reason) is Recovery.PERMANENT:
            continue
        attempts, last = history(cubelet, d.id)
        back = recovery_of(d.reason) is Recovery.HOST_FACT and cubelet.scrub_refusal(d) is None  # the image is here
        if not retry_due(d.reason, attempts, now - max(last or 0.0, d.updated_at), host_fact_back=back):
            continue
        with cubelet.device_locks.hold(d.id):
            problems = probe(cubelet, d)
            attempt = attempts + 1
            details = {
                "attempt": attempt,
                "limit": RETRY_LIMIT,
                "ok": not problems,
                "probe": problems,
                "quarantine_reason": d.reason,
                "exhausted": bool(problems) and attempt >= RETRY_LIMIT,  # an operator's now
            }
            with cubelet.change() as t:
                cur = t.device(d.id)
                if cur is None or (cur.state, cur.generation) != (d.state, d.generation):
                    continue  # an operator decided meanwhile
                t.event(KIND, Actor.CUBELET, device_id=d.id, sandbox_id=d.sandbox_id, reason=d.reason, details=details)
                if not problems:
                    policy = cubelet.scrub_policy(d)
                    owed = policy is ScrubPolicy.TRUSTED_VM and scrub_needs_vm(d)
                    reason = SCRUB_PENDING if owed else None  # the sanitizing stage this return relies on, recorded:
                    t.transition(
                        cur,
                        E.RETRY,
                        Actor.CUBELET,
                        reason=reason,
                        details={**details, "scrub_policy": policy, "scrub_method": scrub_method_name(d)},
                    )
        made.append((d.id, str(d.reason), not problems))
    return made
