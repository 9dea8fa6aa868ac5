"""Background work of one replica: node reconcile, sandbox timeouts, unfinished deletes.

Reconcile compares CubeMaster's sandbox records for a node with the reservations that node's Cubelet
holds, whenever a node registers or comes back from stale (a restarted Cubelet, a network split):
- a record the Cubelet does not know → `failed` with the Cubelet's code and layer when its event trail says the
  reservation closed after a failure (a push that never arrived), else `lost` (the user sees it; the devices
  were never ours to free);
- a reservation CubeMaster has no live record for (a create that died between claim and reply) →
  `DELETE` on the Cubelet, whose release path decides when the devices are safe again.
Master never frees a device itself: a record disappearing only asks the Cubelet to release.

A create whose replica died between `claim()` and the Cubelet's reply leaves a `placing` row that would
count as a claim (and refuse delete) forever; once it is older than any live create could leave it, the
node's Cubelet says what became of it (`resolve_abandoned`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import httpx

from cubeaccel.master.records import SandboxRow
from cubeaccel.master.service import START_FAILED, CubeMaster, sandbox_error
from cubeaccel.master.warm_versions import superseded, versions_of
from cubeaccel.model.event_kinds import EventKind
from cubeaccel.model.reservation_states import ReservationPhase
from cubeaccel.model.sandbox_states import (
    HELD_STATES,
    PLACEMENT_STATES,
    NodeState,
    SandboxActor,
    SandboxEvent,
    SandboxState,
)
from cubeaccel.protocol.errors import CubeError
from cubeaccel.transport.cubelet_client import CubeletClient
from cubeaccel.wire import master_api as W
from cubeaccel.wire.cubelet_api import Failure, Reservation
from cubeaccel.wire.sandbox_timeline import Recovered
from cubeaccel.wire.warm import WARM_ID_PREFIX

SS, SE, MAINT = SandboxState, SandboxEvent, SandboxActor.MAINTENANCE

T = TypeVar("T")
ORPHAN_GRACE_S = 60.0  # a reservation younger than this may belong to a create still in flight
STARTING_POLL_AFTER_S = 5.0  # the Cubelet pushes ready/failed at once; polling is only the fallback


def reconcile_node(master: CubeMaster, name: str) -> dict[str, Any]:
    """Compare the node's records with its Cubelet's reservations; 502 `cubelet.unreachable` if it is down.

    Master rows are read before the reservations: a create that completes in between then shows up as
    `placing` (left alone) instead of as a `running` record the Cubelet "lacks", which would mark it lost
    and release its live reservation as an orphan on the next pass.
    """
    url = master.store.node_url(name)  # its row alone: a reload of every view per node is O(N²) at startup
    if url is None:
        return {"node": name, "skipped": "unknown node"}
    rows = master.store.sandboxes(states=HELD_STATES, node=name)
    held = {r.sandbox_id: r for r in _on_node(master, url, lambda c: c.reservations())}
    lost, orphans, healed = [], [], []
    for row in rows:
        if row.id in held:
            if master.record_workload(row, _node_workload(held[row.id])):
                healed.append(row.id)  # a workload push that never arrived
            continue
        if row.state is SS.DELETING:
            master.store.update_sandbox(row.id, "deleted", expect=(SS.DELETING,), event=SE.DELETED, by=MAINT)
            continue
        failure = _closed_failure(master, url, row.id)
        if failure is not None:
            master.store.update_sandbox(
                row.id,
                "failed",
                expect=(SS.STARTING, SS.RUNNING),
                event=SE.FAIL,
                by=MAINT,
                error=sandbox_error(failure).model_copy(update={"node": name}),
            )
            continue
        master.store.update_sandbox(
            row.id,
            "lost",
            expect=(SS.STARTING, SS.RUNNING),
            event=SE.LOSE,
            by=MAINT,
            error=W.SandboxError(
                code="sandbox.lost",
                layer="cubelet",
                message=f"node {name} holds no reservation for it and no record of its end",
                node=name,
            ),
        )
        lost.append(row.id)
    now = time.time()
    for sid, r in held.items():
        if sid.startswith(WARM_ID_PREFIX):
            continue  # the node's own warm sandbox: no record here until a claim names it (docs/warm.md)
        rec = master.store.sandbox(sid)
        live = rec is not None and rec.node == name and rec.state in (SS.PLACING, *HELD_STATES)
        young = now - r.created_at < ORPHAN_GRACE_S and rec is not None
        if not live and not young:
            _release(master, url, sid)
            orphans.append(sid)
    master.store.mark_reconciled(name, now)
    master.cache.invalidate()
    return {"node": name, "lost": lost, "released_orphans": orphans, "workload_healed": healed}


def _node_workload(r: Reservation) -> W.WorkloadCondition:
    """What the node's reservation says of the sandbox's workload service (its checkpoint keeps the stall)."""
    f = r.facts
    if f.workload_unresponsive_since is None:
        return W.WorkloadCondition(state="answering", since=time.time(), message="read from the node by reconcile")
    return W.WorkloadCondition(state="unresponsive", reason=f.workload_reason, since=f.workload_unresponsive_since)


def _closed_failure(master: CubeMaster, url: str, sid: str) -> Failure | None:
    """The failure the Cubelet recorded when it closed the sandbox's reservation, from its event trail."""
    closed = [
        e
        for e in master.client(url).events(limit=10000, sandbox_id=sid).events
        if e.kind == EventKind.RESERVATION_CLOSED
    ]
    facts = closed[-1].details.get("facts") if closed else None  # the event's details are free-form
    failure = facts.get("failure") if isinstance(facts, dict) else None
    return Failure.model_validate(failure) if isinstance(failure, dict) else None


def poll_starting(master: CubeMaster, row: SandboxRow) -> str:
    """The fallback for a lost push: ask the node what became of a sandbox that is still `starting`."""
    url = master.node_url(row.node)
    if url is None:
        return str(row.state)
    sid = row.id
    try:
        reply = _on_node(master, url, lambda c: c.reservation(sid))
        res, failure = reply.reservation, reply.failure
    except CubeError as e:
        if e.code != "reservation.not_found":
            raise
        res, failure = None, _closed_failure(master, url, sid)
    if failure is not None or res is None:
        error = START_FAILED if failure is None else sandbox_error(failure)
        return master.node_status(str(row.node), sid, "failed", error)
    if res.phase is ReservationPhase.RUNNING:
        return master.node_status(str(row.node), row.id, "running", None)
    return str(row.state)


def resolve_abandoned(master: CubeMaster, row: SandboxRow) -> str:
    """Settle a `scheduling`/`placing` row whose create died (a replica crash between claim and reply).

    Its node's Cubelet decides: a running reservation → `running` (the user's sandbox exists); none → `failed`,
    which also stops the row counting as a claim on the node. A reservation caught half-way (reserved, never
    started) is released through the Cubelet and the row `failed`. Returns the row's state afterwards.
    """
    sid, state = row.id, str(row.state)
    url = master.node_url(row.node) if row.state is SS.PLACING else None
    res: Reservation | None = None
    if url is not None:
        try:
            res = _on_node(master, url, lambda c: c.reservation(sid)).reservation
        except CubeError as e:
            if e.code != "reservation.not_found":
                raise
    if res is not None and res.phase is ReservationPhase.RUNNING:
        master.store.update_sandbox(
            sid,
            "reserved",
            expect=(row.state,),
            event=SE.READY,
            by=MAINT,
            detail=Recovered(node=row.node),
            device_ids=list(res.device_ids),
            cubelet_created_at=res.created_at,
        )
    elif res is not None and res.phase is ReservationPhase.STARTING:
        return state  # the Cubelet is still starting it: look again next tick
    else:
        if res is not None and url is not None:
            _release(master, url, sid)
        master.store.update_sandbox(
            sid,
            "failed",
            expect=(row.state,),
            event=SE.FAIL,
            by=MAINT,
            error=W.SandboxError(
                code="sandbox.placement_abandoned",
                message=f"the create placing it stopped in state {state} "
                f"and node {row.node} holds {'no' if res is None else 'an unstarted'} reservation for it",
            ),
        )
    master.cache.invalidate()
    current = master.store.sandbox(sid)
    return "gone" if current is None else str(current.state)


def _release(master: CubeMaster, url: str, sid: str) -> None:
    """Ask the node to run its release path for `sid` (it decides when the devices are safe again)."""
    _on_node(master, url, lambda c: c.release(sid))


def _on_node(master: CubeMaster, url: str, call: Callable[[CubeletClient], T]) -> T:
    """One call to the node's Cubelet; a transport failure is 502 `cubelet.unreachable`."""
    try:
        return call(master.client(url))
    except httpx.HTTPError as e:
        raise CubeError(
            "cubelet.unreachable", f"Cubelet at {url}: {type(e).__name__}: {e}", "api", {"cubelet_url": url}
        ) from e


class Maintenance:
    def __init__(self, master: CubeMaster, interval_s: float = 1.0, reconcile_every_s: float = 60.0) -> None:
        self.master = master
        self.interval_s = interval_s
        self.reconcile_every_s = reconcile_every_s  # every node, also without a restart: catches orphans
        self._last_full = time.monotonic()
        self._pending: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="master-maintenance", daemon=True)
        self.last_errors: list[str] = []
        self._warm_drain_sent: dict[str, float] = {}  # node → when its warm drain was last sent (master clock)
        self._warm_drain_seen: dict[str, float] = {}  # node → when its undrained pools were first seen draining
        self._warm_rebuild_sent: dict[tuple[str, str], float] = {}  # (node, pool) → when its rebuild was last asked

    def request_reconcile(self, node: str) -> None:
        with self._lock:
            self._pending.add(node)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def tick(self) -> None:
        if time.monotonic() - self._last_full > self.reconcile_every_s:
            self._last_full = time.monotonic()
            now = time.time()
            for v in self.master.cache.views():
                if not v.stale(now, self.master.config.staleness_s):
                    self.request_reconcile(v.name)
        with self._lock:
            pending, self._pending = self._pending, set()
        for node in sorted(pending):
            try:
                reconcile_node(self.master, node)
            except (CubeError, httpx.HTTPError, KeyError) as e:
                self._note(f"reconcile {node}: {e}")
                with self._lock:
                    self._pending.add(node)  # try again next tick
        now = time.time()
        for row in self.master.store.sandboxes(states=PLACEMENT_STATES):
            if self.master.placement_abandoned(row, now):
                try:
                    resolve_abandoned(self.master, row)
                except CubeError as e:
                    self._note(f"abandoned {row.id}: {e}")
        for row in self.master.store.sandboxes(states=(SS.STARTING,)):
            if now - row.updated_at > STARTING_POLL_AFTER_S:
                try:
                    poll_starting(self.master, row)
                except (CubeError, httpx.HTTPError, KeyError) as e:
                    self._note(f"starting {row.id}: {e}")
        for row in self.master.store.sandboxes(states=(SS.STARTING, SS.RUNNING)):
            if row.expires_at is not None and row.expires_at < now:
                self.master.store.update_sandbox(row.id, "timeout", event=SE.TIMEOUT, by=MAINT)
        self._drain_warm_pools(now)
        self._rebuild_superseded_pools(now)
        advertised = {v.name: {w.id for p in v.warm_pools for w in p.sandboxes} for v in self.master.cache.views()}
        if self.master.store.settle_warm_claims(advertised):
            self.master.cache.invalidate()
        revoked = self.master.auth.revoked_tenants()
        if revoked:  # what a revoke raced (a create placed after it, another replica's)
            self.master.end_revoked(revoked, MAINT)
        for row in self.master.store.sandboxes(states=(SS.DELETING,)):
            self.master.release(row)

    def _drain_warm_pools(self, now: float) -> None:
        """A draining node whose heartbeat says its warm pools are not drained is asked again: the drain verb's
        own call may not have reached the Cubelet, or the Cubelet forgot it (`--warm-reset`). Only on a heartbeat
        received after this replica first saw the mismatch (one from before a drain that did arrive says "not
        drained" too), and once per staleness bound per node. Undrain is not converged: a Cubelet's own drain
        (`down`) is not CubeMaster's to undo."""
        for v in self.master.cache.views():
            if (
                v.state != NodeState.DRAINING
                or v.warm_draining is not False
                or v.stale(now, self.master.config.staleness_s)
            ):
                self._warm_drain_seen.pop(v.name, None)
                continue
            seen = self._warm_drain_seen.setdefault(v.name, now)
            if v.received_at <= seen or now - self._warm_drain_sent.get(v.name, 0.0) < self.master.config.staleness_s:
                continue
            self._warm_drain_sent[v.name] = now
            try:
                self.master.client(v.cubelet_url).warm_drain()
            except (CubeError, httpx.HTTPError) as e:
                self._note(f"warm drain {v.name}: {e}")

    def _rebuild_superseded_pools(self, now: float) -> None:
        """A node's warm pool of a template version since superseded here is rebuilt from the latest document
        (master/warm_versions.py); asked once per staleness bound per pool until the heartbeat stops showing it."""
        views = self.master.cache.views()
        names = {p.template for v in views for p in v.warm_pools if p.template}
        if not names:
            return
        latest = {}
        for name in sorted(names):
            try:
                latest[name] = self.master.registry.contract(name)
            except CubeError:  # not registered here: the node operator's pool
                continue
        versions = versions_of(self.master.store.templates(), latest)
        for r in superseded(views, versions, now, self.master.config.staleness_s):
            if now - self._warm_rebuild_sent.get((r.node, r.pool), 0.0) < self.master.config.staleness_s:
                continue
            self._warm_rebuild_sent[(r.node, r.pool)] = now
            try:
                self.master.client(r.cubelet_url).set_warm_pool(r.body)
            except (CubeError, httpx.HTTPError) as e:
                self._note(f"warm pool {r.node}/{r.pool} superseded, not rebuilt: {e}")

    def _note(self, msg: str) -> None:
        self.last_errors = [*self.last_errors[-19:], msg]

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            except Exception as e:  # a failed tick is retried; the error is visible on /v1/health
                self._note(f"tick: {type(e).__name__}: {e}")
