"""Persisted state vs host reality, at startup and periodically, before capacity is advertised.

Checklist per record (design proposal, "Persistence and Reconciliation"): sandbox exists, shim/VMM
exists, device present at its address with the same identity, expected driver bound, no unexpected
holder, health passes, persisted state equals reality. Every repair is an event saying what and why.
Prefer safety: what cannot be proven safe is quarantined; a vanished device stays recorded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from ipaddress import IPv4Address

from cubeaccel.cubelet import backend_facts, host_ready, network_update, scrub_ready
from cubeaccel.cubelet.inventory import host_pass, register_new, validate_initialized
from cubeaccel.cubelet.ports import ReconcileHost
from cubeaccel.cubelet.quarantine_retry import retry_quarantined
from cubeaccel.cubelet.release import problem_event, record_problems
from cubeaccel.host.net import netpolicy
from cubeaccel.model.device import DeviceRecord, DiscoveredDevice
from cubeaccel.model.event_kinds import EventKind
from cubeaccel.model.reservation_states import ReservationPhase
from cubeaccel.model.start_deadlines import startup_timeout_s
from cubeaccel.model.states import Actor, DeviceEvent, DeviceState
from cubeaccel.protocol.errors import CubeError

S, E = DeviceState, DeviceEvent


@dataclass(frozen=True)
class Repair:
    device_id: str | None
    sandbox_id: str | None
    what: str
    why: str


def _record(cubelet: ReconcileHost, repairs: list[Repair], r: Repair) -> None:
    repairs.append(r)
    with cubelet.store.tx() as t:
        t.event(
            EventKind.RECONCILE_REPAIR,
            Actor.CUBELET,
            device_id=r.device_id,
            sandbox_id=r.sandbox_id,
            reason=r.why,
            details={"what": r.what},
        )


def _presence_problem(d: DeviceRecord, found: dict[str, DiscoveredDevice]) -> str | None:
    f = found.get(d.id)
    if f is None:
        return "host.device_missing"
    if f.identity != d.identity:
        return "host.identity_changed"
    return None


Later = list[Callable[[], None]]


def _teardown(cubelet: ReconcileHost, sandbox_id: str, reason: str, kill: bool = False) -> Callable[[], None]:
    """A teardown the pass starts after its host snapshot is closed: release work reads the live host."""

    def run() -> None:
        if kill:
            res = cubelet.store.reservation(sandbox_id)
            cubelet.shim.kill(sandbox_id if res is None else res.shim_id)
        cubelet.begin_teardown(sandbox_id, reason)

    return run


def _check_tenant(cubelet: ReconcileHost, d: DeviceRecord, repairs: list[Repair], later: Later) -> None:
    """reserved/preparing/attached: the sandbox, its shim and its VMM must still be there."""
    sid = d.sandbox_id
    res = cubelet.store.reservation(sid) if sid else None
    if res is None or d.id not in res.device_ids:
        with cubelet.store.tx() as t:
            cur = t.device(d.id)
            if cur is not None and cur.state is d.state:
                t.transition(cur, E.QUARANTINE, Actor.CUBELET, reason="reconcile.no_reservation")
        _record(cubelet, repairs, Repair(d.id, sid, "quarantined", "tenant state without a reservation"))
        return
    if res.phase is ReservationPhase.RELEASING:
        return  # the release path below owns it
    if not res.checkpoint.shim_started:
        return  # reserved, not started: the TTL covers it
    with cubelet.lock:
        if res.sandbox_id in cubelet.launching:
            return  # its shim is being launched right now (outside the lock): no evidence either way yet
    st = cubelet.shim.status(res.shim_id)
    if st.vmm_alive is None:
        with cubelet.store.tx() as t:
            cur = t.device(d.id)
            if cur is not None and cur.state is d.state:
                t.transition(cur, E.QUARANTINE, Actor.CUBELET, reason="reconcile.vmm_state_unknown")
        _record(cubelet, repairs, Repair(d.id, sid, "quarantined", "cannot tell whether the VMM runs"))
    elif not st.vmm_alive:
        if st.shim_alive and not res.checkpoint.vmm_pid:
            started = res.checkpoint.started_at or 0.0
            limit = startup_timeout_s(res.params.memory_mib, cubelet.config.startup_timeout_s)
            if float(cubelet.store.clock()) - started <= limit:
                return  # the shim is still starting its VMM
            _record(cubelet, repairs, Repair(d.id, sid, "teardown", "the shim did not start a VMM in time"))
            later.append(_teardown(cubelet, res.sandbox_id, "reconcile.startup_timeout", kill=True))
            return
        _record(cubelet, repairs, Repair(d.id, sid, "teardown", "VMM is gone"))
        later.append(_teardown(cubelet, res.sandbox_id, "reconcile.vmm_gone"))
    elif st.shim_alive is False:
        _record(cubelet, repairs, Repair(d.id, sid, "teardown", "shim died; orphaned VMM is stopped"))
        later.append(_teardown(cubelet, res.sandbox_id, "reconcile.shim_gone", kill=True))


def _unchanged(cur: DeviceRecord | None, d: DeviceRecord) -> bool:
    """The compare-and-swap a check's outcome needs: the record the host work looked at is still the one stored."""
    return cur is not None and (cur.state, cur.generation) == (d.state, d.generation)


def reconcile(cubelet: ReconcileHost) -> list[Repair]:
    """One pass, one device at a time: host I/O runs under that device's lock with no transaction open and
    without the lifecycle lock, so reservations, releases and reads go on during a pass."""
    repairs: list[Repair] = []
    later: Later = []
    with host_pass(cubelet):
        discovered = cubelet.backend.discover()
        for dev_id in register_new(cubelet, discovered):  # new devices: one transaction
            _record(cubelet, repairs, Repair(dev_id, None, "registered", "device appeared on the host"))
        host_ready.check(cubelet)  # a host that is not ready holds its devices back (an event when it changes)
        scrub_ready.check(cubelet)  # so does a class whose scrub image is gone; one that is back is served again
        found = {d.device_id: d for d in discovered}
        for d in cubelet.store.devices():
            _check_device(cubelet, d, found, repairs, later)
        validate_initialized(cubelet, discovered)
    for run in later:
        run()
    _replay_reports(cubelet, repairs)
    _end_warm_leftovers(cubelet, repairs)
    for res in cubelet.store.reservations():
        if res.phase is ReservationPhase.RELEASING:
            cubelet.try_release(res.sandbox_id)
    for dev_id, reason, passed in retry_quarantined(cubelet):  # transient quarantines, bounded (model/recovery.py)
        repairs.append(Repair(dev_id, None, "retried" if passed else "retry_failed", reason))
    _released_without_reservation(cubelet, repairs)  # a retried device's scrub and revalidation start here
    cubelet.retire_runs()  # files of runs a crash left behind (no reservation, no process)
    for sid in cubelet.expire_reservations():
        repairs.append(Repair(None, sid, "expired", "reserve.expired"))
    health_check(cubelet)
    backend_facts.persist(cubelet)
    _reload_networks(cubelet, repairs)
    return repairs


def _check_device(
    cubelet: ReconcileHost, d: DeviceRecord, found: dict[str, DiscoveredDevice], repairs: list[Repair], later: Later
) -> None:
    """One device against the host: gone from it, no longer valid while free, or held for a tenant."""
    if d.state in (S.DISABLED, S.QUARANTINED, S.UNHEALTHY):
        return  # parked: an operator brings these back (transient quarantines: retry_quarantined)
    missing = _presence_problem(d, found)
    if missing is not None:
        with cubelet.change() as t:
            cur = t.device(d.id)
            if cur is not None and cur.state is d.state:
                t.transition(cur, E.HEALTH_FAILED, Actor.CUBELET, reason=missing)
        _record(cubelet, repairs, Repair(d.id, d.sandbox_id, "unhealthy", missing))
        if d.sandbox_id and cubelet.store.reservation(d.sandbox_id):
            later.append(_teardown(cubelet, d.sandbox_id, missing))
        return
    if d.state is S.ALLOCATABLE:
        _revalidate_free(cubelet, d, repairs)
    elif d.state in (S.RESERVED, S.PREPARING, S.ATTACHED):
        _check_tenant(cubelet, d, repairs, later)


def _revalidate_free(cubelet: ReconcileHost, d: DeviceRecord, repairs: list[Repair]) -> None:
    with cubelet.device_locks.hold(d.id):
        refused = cubelet.scrub_refusal(d)  # a policy made stricter across a restart: out, untouched
        problems = [refused] if refused is not None else cubelet.backend.validate(d)
        if not problems:
            return
        event, reason = problem_event(problems)
        with cubelet.change() as t:
            cur = t.device(d.id)
            applied = _unchanged(cur, d)
            if applied and cur is not None:
                record_problems(t, cur, problems)
        if applied:
            _record(cubelet, repairs, Repair(d.id, None, event.value, reason))


def _replay_reports(cubelet: ReconcileHost, repairs: list[Repair]) -> None:
    """Shim reports that could not be delivered while the Cubelet was down, in the order they were written."""
    for res in cubelet.store.reservations():
        late = cubelet.shim.pending_reports(res.shim_id)
        if not late:
            continue
        message = f"{len(late)} shim report(s) undelivered while Cubelet was down"
        _record(cubelet, repairs, Repair(None, res.sandbox_id, "replayed", message))
        for report in late:
            cubelet.handle_report(report)


def _end_warm_leftovers(cubelet: ReconcileHost, repairs: list[Repair]) -> None:
    for sid in cubelet.warm.unacknowledged():  # the journal says claimed, the shim never said so (docs/warm.md)
        cubelet.begin_teardown(sid, "warm.claim_unacknowledged", message="the warm shim never acknowledged the claim")
        repairs.append(Repair(None, sid, "failed", "warm.claim_unacknowledged"))
    for sid in cubelet.warm.orphans():  # warm sandboxes of a pool not kept here: never claimable, never counted
        cubelet.begin_teardown(sid, "warm.no_pool", message="no warm pool of this sandbox's shape is kept here")
        repairs.append(Repair(None, sid, "failed", "warm.no_pool"))


def _reload_networks(cubelet: ReconcileHost, repairs: list[Repair]) -> None:
    """Each live sandbox network's ruleset as the journal says, with the node's addresses as they are now: an
    address the host gained after a sandbox's network was built is no destination there either
    (host/net/netpolicy.py), and a policy change journaled by a Cubelet that died before loading it is loaded now.
    One address read per uplink per pass; a ruleset is loaded again only when it would differ."""
    now: dict[str | None, frozenset[IPv4Address]] = {}
    live: set[str] = set()
    for res in cubelet.store.reservations():
        net, sid = res.checkpoint.network, res.sandbox_id
        if not net or res.phase is ReservationPhase.RELEASING or not netpolicy.exists(sid):
            continue
        live.add(sid)
        uplink = net.get("uplink_netns")
        try:
            if uplink not in now:
                now[uplink] = frozenset(netpolicy.node_addresses(uplink))
            network_update.reload(cubelet, sid, now[uplink])
        except CubeError as e:
            if netpolicy.exists(sid):  # not a release racing this pass
                _record(cubelet, repairs, Repair(None, sid, "network_refresh_failed", e.code))
    for gone in set(cubelet.loaded_networks) - live:
        del cubelet.loaded_networks[gone]


def _released_without_reservation(cubelet: ReconcileHost, repairs: list[Repair]) -> None:
    """A crash between release_confirmed and revalidated leaves `released`: revalidate now."""
    for d in cubelet.store.devices():
        res = cubelet.store.reservation(d.sandbox_id) if d.sandbox_id else None
        orphan = d.state is S.RELEASING and not (res and d.id in res.device_ids)
        if d.state is not S.RELEASED and not orphan:
            continue
        with cubelet.device_locks.hold(d.id):
            if d.state is S.RELEASED and cubelet.advance_scrub(d.id):
                continue  # the scrub owns it: revalidated (or quarantined) when the scrub VM is done
            problems = cubelet.backend.validate(d) if d.state is S.RELEASED else []
            with cubelet.change() as t:
                cur = t.device(d.id)
                if cur is None or not _unchanged(cur, d):
                    continue
                if cur.state is S.RELEASING:
                    t.transition(cur, E.QUARANTINE, Actor.CUBELET, reason="reconcile.releasing_without_reservation")
                    what = "quarantined"
                elif problems:
                    what = record_problems(t, cur, problems).state.value
                else:
                    t.transition(cur, E.REVALIDATED, Actor.CUBELET, sandbox_id=None)
                    what = "revalidated"
        why = f"{d.state.value} left by an interrupted release"
        _record(cubelet, repairs, Repair(d.id, d.sandbox_id, what, why))


def health_check(cubelet: ReconcileHost) -> None:
    """Periodic: a hard failure on an attached device makes it unhealthy and tears its sandbox down."""
    for d in cubelet.store.devices():
        if d.state not in (S.ATTACHED, S.PREPARING):
            continue
        with cubelet.device_locks.hold(d.id):
            problems = [p for p in cubelet.backend.health(d) if p.hard]
            if not problems:
                continue
            with cubelet.change() as t:
                cur = t.device(d.id)
                if cur is None or cur.state is not d.state:
                    continue
                record_problems(t, cur, problems)
        if d.sandbox_id:
            cubelet.begin_teardown(d.sandbox_id, problems[0].code)
