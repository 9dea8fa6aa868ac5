"""CubeMaster: two-phase placement (decide from summaries, then the Cubelet reserves), delete, status.

Create: validate everything first (template, class, count, CEL compile) so a bad request is a 4xx
and changes nothing; insert the sandbox row (`scheduling`; the id and the idempotency key are unique,
so a retried or duplicated create returns the existing sandbox); decide; claim the best candidate
under its node's row lock; ask that Cubelet to reserve and start. A Cubelet refusal (stale summary:
`reserve.insufficient_devices`, `compat.*`) or an unreachable Cubelet gives the claim back and tries
the next candidate, at most `max_attempts` times. Nothing placed → the row is removed and the user gets
the reasons (`schedule.unschedulable`).
"""

from __future__ import annotations

import secrets
import threading
import time
import uuid
from collections.abc import Callable, Collection
from contextlib import suppress
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import httpx
from pydantic import ValidationError

from cubeaccel.master.auth import Auth
from cubeaccel.master.cache import NodeCache
from cubeaccel.master.capacity_wait import CAPACITY_REFUSALS, ArrivalQueue, Turn, returning, returning_groups
from cubeaccel.master.records import IdempotencyRecord, Refusal, SandboxRow
from cubeaccel.master.registry import Registry
from cubeaccel.master.scheduler import Candidate, Decision, rejection
from cubeaccel.master.selector import Selector, compile_selector
from cubeaccel.master.shown import LIVE_STATES, shown_state, workload_condition
from cubeaccel.master.store import MasterStore
from cubeaccel.master.warm import CLAIM_FAILED, POOL_EMPTY, WarmAsk, WarmCandidate, claim_phases
from cubeaccel.master.warm import candidates as warm_candidates
from cubeaccel.master.warm import refilling as warm_refilling
from cubeaccel.model.contract import CompatibilityContract
from cubeaccel.model.request import AcceleratorChoice, AcceleratorRequest
from cubeaccel.model.reservation_states import ReservationPhase
from cubeaccel.model.sandbox_policy import narrow_network
from cubeaccel.model.sandbox_states import PLACEMENT_STATES, SandboxActor, SandboxEvent, SandboxState
from cubeaccel.protocol.errors import CubeError
from cubeaccel.transport.cubelet_client import CubeletClient
from cubeaccel.wire import master_api as W
from cubeaccel.wire.cubelet_api import Failure, ReservationBody, ReservationView
from cubeaccel.wire.cubelet_api import TimelineEntry as CubeletStep
from cubeaccel.wire.master_api import MAX_LIFETIME_S
from cubeaccel.wire.sandbox_timeline import (
    WORKLOAD_RECOVERED,
    WORKLOAD_UNRESPONSIVE,
    AbandonedDelete,
    ColdPath,
    ReserveAttempt,
    Reserved,
    Scheduled,
    TimeoutSet,
    WarmAttempt,
    WarmPath,
    WorkloadChanged,
)
from cubeaccel.wire.warm import WARM_ID_PREFIX, WarmClaimBody

SS, SE, SA = SandboxState, SandboxEvent, SandboxActor
SandboxT = TypeVar("SandboxT", bound=W.Sandbox)

# A start whose reservation closed with no failure recorded (a Cubelet that predates failure records).
START_FAILED = W.SandboxError(
    code="sandbox.start_failed", layer="cubelet", message="the reservation closed during start"
)
LIFETIME_SLACK_S = 60.0  # CubeMaster times a sandbox out first; the Cubelet's own lifetime is the backstop
RETRYABLE = (
    "reserve.insufficient_devices",
    "compat.",
    "prepare.revalidation_failed",
    "reserve.pinned_memory",
    "host.not_ready",
)


@dataclass(frozen=True)
class MasterConfig:
    staleness_s: float = 10.0  # a node whose last heartbeat is older is `node_stale`
    max_attempts: int = 4  # Cubelets asked per create before giving up
    cubelet_timeout_s: float = 30.0
    default_lifetime_s: float = 3600.0  # every sandbox has a lifetime; a tenant's quota may set its own
    # How long a create waits for devices being released or scrubbed (issue 29): below the front door's 30 s
    # call to CubeMaster and the E2B SDK's 60 s request timeout. `CreateSpec.capacity_wait_s` overrides it.
    capacity_wait_s: float = 20.0
    capacity_waiters: int = 8  # creates waiting at once per replica (each holds a worker thread)

    @property
    def placement_stale_s(self) -> float:
        """A `scheduling`/`placing` row untouched this long belongs to a create that died (a replica crash).

        A live create touches its row at every step and waits at most one Cubelet request per step; httpx's
        timeout applies per phase (connect, then read), hence twice the request timeout.
        """
        return 2 * self.cubelet_timeout_s


@dataclass(frozen=True)
class CreateSpec:
    """A validated create request (built by the API layer)."""

    sandbox_id: str | None
    tenant: str
    idempotency_key: str | None
    template: str | None
    request: AcceleratorRequest
    memory_mib: int | None
    vcpus: int
    timeout_s: float | None
    metadata: dict[str, str] = field(default_factory=dict)  # the caller's labels: stored, returned, filterable
    env_vars: dict[str, str] = field(default_factory=dict)  # for every command (the E2B front door applies them)
    workload_token: str | None = field(default=None, repr=False)  # the caller's choice; passed on, never stored
    network: dict[str, Any] | None = None  # narrows the template's network policy
    capacity_wait_s: float | None = None  # None: MasterConfig.capacity_wait_s


Resolved = tuple[AcceleratorChoice, CompatibilityContract, Selector | None]


class CubeMaster:
    def __init__(self, store: MasterStore, config: MasterConfig | None = None) -> None:
        self.store = store
        self.config = config or MasterConfig()
        self.registry = Registry(store)
        self.cache = NodeCache(store)
        self.waiters = ArrivalQueue(self.config.capacity_waiters)  # creates waiting for capacity coming back
        self.auth = Auth(store)
        self._clients: dict[tuple[str, str | None], CubeletClient] = {}
        self._clients_lock = threading.Lock()
        self.issued_tokens: dict[str, str] = {}  # sandbox → its workload token until the create's reply takes it
        self.on_decision: Callable[[Decision, float], None] | None = None  # metrics: each decision and its time
        self.on_path: Callable[[str, str], None] | None = None  # metrics: each create's path (warm|cold), reason

    def client(self, url: str) -> CubeletClient:
        """A client for the Cubelet at `url`, presenting that node's token (its TCP API asks for it)."""
        node = self.cache.node_at(url)
        token = None if node is None else self.auth.current_node_token(node)
        with self._clients_lock:
            c = self._clients.get((url, token))
            if c is None:
                c = self._clients[(url, token)] = CubeletClient(
                    url=url, timeout=self.config.cubelet_timeout_s, token=token
                )
            return c

    # ---- create -----------------------------------------------------------------------------------
    def resolve(self, spec: CreateSpec) -> list[Resolved]:
        """Template per choice (explicit, else the class default) and compiled selectors: 4xx on any error."""
        out: list[Resolved] = []
        explicit = self.registry.contract(spec.template) if spec.template else None
        for ch in spec.request.choices:
            c = explicit or self.registry.default_for(ch.accel_class)
            if c.accel_class != ch.accel_class:
                raise CubeError(
                    "request.class_mismatch",
                    f"template {c.template_name} is for class {c.accel_class}, the request asks for {ch.accel_class}",
                    "api",
                    {"template_class": c.accel_class, "requested": ch.accel_class},
                )
            if spec.memory_mib is not None and spec.memory_mib != c.memory_mib:
                # The template fixes the guest's memory (its snapshot, its pinned-memory check): a request that
                # asks for another size is refused, never silently given the template's.
                raise CubeError(
                    "request.memory_mismatch",
                    f"memory_mib {spec.memory_mib} differs from template {c.template_name}'s {c.memory_mib} MiB",
                    "api",
                    {"requested": spec.memory_mib, "template": c.template_name, "template_memory_mib": c.memory_mib},
                )
            narrow_network(c.template.sandbox.network, spec.network)  # refused here, before any placement
            out.append((ch, c, compile_selector(ch.selector) if ch.selector else None))
        return out

    def create(self, spec: CreateSpec) -> tuple[SandboxRow, bool]:
        """Returns (sandbox, created): created is False for an idempotent repeat."""
        if spec.sandbox_id is not None and spec.sandbox_id.startswith(WARM_ID_PREFIX):
            # The nodes' own warm sandboxes' ids: refused before any node is asked, since a claim or a cleanup
            # under such an id would reach the node's warm sandbox of that name.
            raise CubeError(
                "sandbox.reserved_id",
                f"sandbox ids starting {WARM_ID_PREFIX!r} are the nodes' warm sandboxes'; choose another or leave"
                " `id` out",
                "api",
                {"reserved_prefix": WARM_ID_PREFIX},
            )
        resolved = self.resolve(spec)
        if spec.tenant in self.auth.revoked_tenants():  # an admin's create for it, too (issue 30 #2)
            raise CubeError("tenant.not_found", f"no live tenant {spec.tenant!r}", "api")
        quota = self.auth.quota(spec.tenant)
        lifetime = spec.timeout_s or quota.default_lifetime_s or self.config.default_lifetime_s
        if not spec.timeout_s and quota.max_lifetime_s is not None:  # a default never exceeds the tenant's cap
            lifetime = min(lifetime, quota.max_lifetime_s)
        if quota.max_lifetime_s is not None and lifetime > quota.max_lifetime_s:
            raise CubeError(
                "quota.lifetime",
                f"tenant {spec.tenant}'s sandboxes live at most {quota.max_lifetime_s:g}s; asked for {lifetime:g}s",
                "scheduler",
                {"max_lifetime_s": quota.max_lifetime_s, "requested_s": lifetime},
            )
        now = time.time()
        sid = spec.sandbox_id or f"sb-{uuid.uuid4().hex[:16]}"
        normalized: dict[str, Any] = {
            "template": spec.template,
            "accelerators": [spec.request.to_json()],
            "memory_mib": spec.memory_mib,
            "vcpus": spec.vcpus,
            "timeout_s": spec.timeout_s,
        }
        # Only when given, so the records (and idempotency records) of creates without them keep their shape.
        if spec.metadata:
            normalized["metadata"] = dict(spec.metadata)
        if spec.env_vars:
            normalized["env_vars"] = dict(spec.env_vars)
        if spec.network is not None:
            normalized["network"] = spec.network
        network = narrow_network(resolved[0][1].template.sandbox.network, spec.network) if resolved else None
        if network is not None and network.has_nic:
            normalized["network_policy"] = network.to_json()  # the effective one, as `sandbox show` prints it
        salt = None if spec.workload_token is not None else secrets.token_hex(16)
        if salt is not None:  # the token is ours: derived, so the owner can get it again (connect)
            spec = replace(spec, workload_token=self.auth.workload_token(sid, salt))
        row = SandboxRow(
            id=sid,
            tenant=spec.tenant,
            idempotency_key=spec.idempotency_key,
            request=W.SandboxRequest.model_validate(normalized),
            state=SS.SCHEDULING,  # born here; every later change is an event through the table
            count=spec.request.primary.count,
            timeline=(W.TimelineEntry(at=now, phase="requested"),),
            created_at=now,
            updated_at=now,
            expires_at=now + lifetime,
            token_salt=salt,
        )
        existing = self._claim(row, spec)
        if existing is not None:
            return existing, False
        try:
            return self._place(sid, spec, resolved), True
        except BaseException as e:
            # A refused create leaves no record behind, but its idempotency record keeps the refusal for a retry.
            # A create that died after its claim may have left a reservation on the Cubelet: with no record,
            # the next reconcile releases it there.
            self.store.refuse_create(sid, Refusal.of(e) if isinstance(e, CubeError) else None)
            self.cache.invalidate()
            raise

    def _claim(self, row: SandboxRow, spec: CreateSpec) -> SandboxRow | None:
        """Record the create (None), or the outcome an earlier create with the same id or key had: its record
        once it left placement, or its refusal raised again. A twin that arrives while the first is still
        placing waits for that outcome rather than answer with a record that a refusal is about to delete."""
        deadline = time.monotonic() + self.config.placement_stale_s
        while True:
            kind, existing = self.store.insert_or_existing(row)
            if kind == "inserted":
                return None
            if isinstance(existing, IdempotencyRecord):  # refused
                assert existing.refusal is not None
                self._same_request(existing.request.model_dump(mode="json"), existing.sandbox_id, row)
                raise existing.refusal.replayed()
            if existing is not None:
                self._same_request(existing.request_json(), existing.id, row, existing.tenant)
                if existing.state not in PLACEMENT_STATES or self.placement_abandoned(existing, time.time()):
                    return existing
            if time.monotonic() > deadline:
                raise CubeError(
                    "sandbox.create_in_progress",
                    f"sandbox {row.id if existing is None else existing.id} is still being placed; retry",
                    "api",
                )
            time.sleep(0.05)

    @staticmethod
    def _same_request(request: dict[str, Any], sandbox_id: str, row: SandboxRow, tenant: str | None = None) -> None:
        if request != row.request_json() or (tenant is not None and tenant != row.tenant):
            # The earlier request is shown only to its own tenant: env vars are secrets (issue 30 #1). Tenants
            # cannot reach another's id (their ids are namespaced); this guards an admin's create for a tenant.
            mine = tenant is None or tenant == row.tenant
            raise CubeError(
                "sandbox.conflict",
                f"sandbox {sandbox_id} exists with another request",
                "api",
                {"existing": request} if mine else {},
            )

    def _place(self, sid: str, spec: CreateSpec, resolved: list[Resolved]) -> SandboxRow:
        bound = self.config.capacity_wait_s if spec.capacity_wait_s is None else spec.capacity_wait_s
        turn = Turn(self.waiters, bound)  # this create's wait for capacity, its ticket held until placed
        try:
            warm = self._claim_warm(sid, spec, resolved)
            if warm is not None:
                return warm
            try:
                return self._place_in_turn(sid, spec, resolved, turn)
            except CubeError as e:
                if e.code.startswith("schedule."):  # say what warm sandboxes hold: not free for this request
                    held = {v.name: n for v in self.cache.views() if (n := sum(p.warm for p in v.warm_pools))}
                    if held:
                        e.details["warm_held"] = held
                raise
        finally:
            turn.leave()

    def _wait_for_capacity(
        self, sid: str, spec: CreateSpec, resolved: list[Resolved], decision: Decision, turn: Turn
    ) -> tuple[Decision, int, dict[tuple[str, str], int]] | SandboxRow | None:
        """A decision with candidates once devices coming back are back, in arrival order, or one placing the
        head of the queue on them where the node's reserve waits for them itself (with, per node and group, the
        devices coming back its claim may count on); the sandbox itself when a warm start of its shape that was
        on the way became warm and was claimed; None when nothing that fits is coming back (refuse at once);
        `schedule.capacity_returning` when the bound passes."""
        back = self._coming_back(spec, resolved, decision)
        if not back:
            return None
        turn.join(back)
        while True:
            turn.wait_turn(back)
            if self._warm_ready(spec, resolved) and (row := self._claim_warm(sid, spec, resolved)) is not None:
                return row
            fresh, total = self.cache.decide(resolved, time.time(), self.config.staleness_s, spec.vcpus, fresh=True)
            if fresh.candidates:
                return fresh, total, {}
            views = {v.name: v for v in self.cache.views()}
            groups = returning_groups(fresh, views, self.store.deleting_devices())
            back = self._coming_back(spec, resolved, fresh)
            if not back:
                return None
            waiting = [r for r in groups if r.node.reserve_waits and r.alternative == groups[0].alternative]
            if waiting:  # the node keeps the device for this create from its return (cubelet/capacity_wait.py)
                choice, contract, _ = resolved[groups[0].alternative]
                cands = [Candidate(r.node, r.group, (float(r.back),)) for r in waiting]
                owed = {(r.node.name, r.group.key): r.back for r in waiting}
                return Decision(choice, contract, cands, fresh.outcomes), total, owed
            turn.pause()

    def _coming_back(self, spec: CreateSpec, resolved: list[Resolved], decision: Decision) -> int:
        """Devices coming back that would fit, plus warm sandboxes of the create's own shape on the way or ready
        (a refill that took the device is capacity in motion for a create it would fit)."""
        views, now, stale = self.cache.views(), time.time(), self.config.staleness_s
        back = returning(decision, {v.name: v for v in views}, self.store.deleting_devices())
        ask = WarmAsk(resolved, spec.memory_mib, spec.vcpus, self._effective_network(spec, resolved))
        ready = sum(len(c.warm_ids) for c in warm_candidates(views, ask, now, stale)[0])
        return back + warm_refilling(views, ask, now, stale) + ready

    def _warm_ready(self, spec: CreateSpec, resolved: list[Resolved]) -> bool:
        """A warm sandbox of the create's shape is advertised and unclaimed (a refill that was on the way)."""
        ask = WarmAsk(resolved, spec.memory_mib, spec.vcpus, self._effective_network(spec, resolved))
        return bool(warm_candidates(self.cache.views(), ask, time.time(), self.config.staleness_s)[0])

    def _place_in_turn(self, sid: str, spec: CreateSpec, resolved: list[Resolved], turn: Turn) -> SandboxRow:
        t0 = time.perf_counter()
        attempts: list[ReserveAttempt] = []
        tried: set[tuple[str, str]] = set()
        # Nodes that refused for capacity their summary showed free (capacity in motion: a release, a scrub, the
        # warm refill): tried again once a heartbeat newer than the refusal arrived.
        held: dict[str, float] = {}
        lost = 0  # claims another placement won first
        quick = 0  # decisions that did not wait: three, as before, then the create gives up
        while True:
            t_decide = time.perf_counter()
            decision, total = self.cache.decide(
                resolved, time.time(), self.config.staleness_s, spec.vcpus, fresh=quick > 0
            )
            quick += 1
            if self.on_decision is not None and (decision.candidates or quick > 1):  # the one acted on
                self.on_decision(decision, time.perf_counter() - t_decide)
            for node, refused_at in list(held.items()):
                if any(v.name == node and v.received_at > refused_at for v in self.cache.views()):
                    tried = {k for k in tried if k[0] != node}
                    del held[node]
            owed: dict[tuple[str, str], int] = {}  # placed on devices coming back: those its claim counts on
            if not any((c.node.name, c.group.key) not in tried for c in decision.candidates):
                if quick == 1:
                    continue  # our copy may be old: decide once more on fresh summaries
                if held and turn.try_join():  # capacity in motion there: wait, in turn, for their word since
                    turn.wait_turn(len(held))
                    turn.pause()
                    quick = 1
                    continue
                if decision.candidates:
                    break  # every candidate was tried and refused for another reason
                waited = self._wait_for_capacity(sid, spec, resolved, decision, turn)
                if waited is None:
                    raise _with_attempts(rejection(decision, total), attempts)
                if isinstance(waited, SandboxRow):
                    return waited
                decision, total, owed = waited
                if all((c.node.name, c.group.key) in tried for c in decision.candidates):
                    break  # the nodes it would wait on refused it already, for another reason
                quick = 1
            assert decision.contract is not None and decision.choice is not None
            decided_ms = (time.perf_counter() - t0) * 1000
            for cand in decision.candidates:
                if len([a for a in attempts if not a.code.startswith(CAPACITY_REFUSALS)]) >= self.config.max_attempts:
                    break
                if (cand.node.name, cand.group.key) in tried:
                    continue
                tried.add((cand.node.name, cand.group.key))
                t = decision.contract.template
                pinned = cand.node.locked_mib(t.memory_mib, spec.vcpus, t.pin_memory)
                if not self.store.admit(
                    sid,
                    cand.node.name,
                    cand.group.key,
                    decision.choice.count,
                    time.time(),
                    self.config.staleness_s,
                    pinned,
                    tenant=spec.tenant,
                    accel_class=decision.choice.accel_class,
                    returning=owed.get((cand.node.name, cand.group.key), 0),
                ):
                    lost += 1
                    continue  # another placement got there first; not a Cubelet attempt
                self.cache.note_admitted(cand.node.name, cand.group.key, decision.choice.count, pinned)
                self.store.update_sandbox(
                    sid,
                    "scheduled",
                    detail=Scheduled(
                        node=cand.node.name,
                        decision_ms=round(decided_ms, 3),
                        group=dict(cand.group.labels),
                        score=list(cand.score),
                    ),
                )
                refused_at = time.time()
                placed = self._reserve(sid, spec, cand, decision.choice, decision.contract, attempts, turn)
                if placed is not None:
                    return placed
                if attempts[-1].code.startswith(CAPACITY_REFUSALS):
                    back = owed.get((cand.node.name, cand.group.key))
                    if back and turn.left() <= 0:  # the node waited for them as long as we may
                        raise turn.expired(back)
                    held[cand.node.name] = refused_at
            if len([a for a in attempts if not a.code.startswith(CAPACITY_REFUSALS)]) >= self.config.max_attempts:
                break
            if quick >= 3 and not held:
                break
        raise CubeError(
            "schedule.placement_failed",
            f"{len(attempts)} node(s) refused the reservation and "
            f"{lost} candidate(s) were taken by concurrent placements; retry",
            "scheduler",
            {"attempts": [a.model_dump(mode="json") for a in attempts], "claims_lost": lost},
        )

    def _reserve(
        self,
        sid: str,
        spec: CreateSpec,
        cand: Candidate,
        choice: AcceleratorChoice,
        contract: CompatibilityContract,
        attempts: list[ReserveAttempt],
        turn: Turn | None = None,
    ) -> SandboxRow | None:
        raw: dict[str, Any] = {
            "sandbox_id": sid,
            "count": choice.count,
            "class": choice.accel_class,
            "labels": dict(cand.group.labels),
            "template": contract.template_name,
            "contract": contract,
            "memory_mib": spec.memory_mib or contract.memory_mib,
            "vcpus": spec.vcpus,
            "start": True,
            "workload_token": spec.workload_token,
            "network": spec.network,  # Cubelet narrows again: it trusts no policy it did not derive
        }
        if turn is not None and cand.node.reserve_waits and (left := turn.left()) > 0:
            # devices coming back there are waited for on the node, in its arrival order, within our bound and
            # under the request's own timeout (the start follows the reserve in the same call)
            raw["capacity_wait_s"] = round(min(left, max(0.0, self.config.cubelet_timeout_s - 10)), 3)
        row = self.store.sandbox(sid)
        if row is not None:  # the Cubelet's backstop: the longest this sandbox may live (set_timeout extends ours)
            raw["tenant"] = row.tenant  # and whose it is: the node's audit trail names who had the device
            deadline = row.created_at + self._lifetime_cap(row.tenant)
            raw["lifetime_s"] = max(1.0, deadline - time.time() + LIFETIME_SLACK_S)
        try:
            reply = self.client(cand.node.cubelet_url).reserve(ReservationBody.model_validate(raw))
        except (CubeError, httpx.HTTPError, ValidationError) as e:  # a malformed 201: as unreachable
            code = e.code if isinstance(e, CubeError) else "cubelet.unreachable"
            attempts.append(ReserveAttempt(node=cand.node.name, code=code, message=str(e)[:300]))
            self.store.update_sandbox(
                sid,
                "reserve_refused",
                detail=attempts[-1],
                event=SE.REFUSED,
                by=SA.PLACEMENT,
                node=None,
                group_key=None,
            )
            self.cache.invalidate()
            if isinstance(e, CubeError) and not code.startswith(RETRYABLE) and e.status < 500:
                raise CubeError(
                    code, f"{cand.node.name}: {e.message}", e.layer, {**e.details, "node": cand.node.name}, e.status
                ) from e
            return None
        if reply.access_token is not None:
            self.issued_tokens[sid] = reply.access_token  # passed to the create's caller, never stored
        event, error = _start_outcome(reply)
        self.store.update_sandbox(
            sid,
            "reserved",
            expect=(SS.PLACING,),
            detail=Reserved(node=cand.node.name, cubelet_timeline=_timeline(reply)),
            event=event,
            by=SA.PLACEMENT,
            device_ids=[] if reply.reservation is None else list(reply.reservation.device_ids),
            accel_class=choice.accel_class,
            count=choice.count,
            template_name=contract.template_name,
            template_version=contract.template_version,
            contract=contract.to_json(),
            cubelet_created_at=None if reply.reservation is None else reply.reservation.created_at,
            error=error,
        )
        row = self.store.sandbox(sid)
        assert row is not None
        return row

    # ---- warm claim (docs/warm.md) ------------------------------------------------------------------
    def _claim_warm(self, sid: str, spec: CreateSpec, resolved: list[Resolved]) -> SandboxRow | None:
        """Hand the create a matching warm sandbox, or None (the cold path follows) with the miss reason in the
        timeline. Each try: a claim row for one advertised warm id under the node's row lock (with the tenant's
        quota, which may refuse the create outright), then the Cubelet's claim of exactly that id, whose
        journal CAS decides. A claim that did not hand a sandbox over gives the row back to `scheduling`."""
        network = self._effective_network(spec, resolved)
        views, now, stale = self.cache.views(), time.time(), self.config.staleness_s
        ask = WarmAsk(resolved, spec.memory_mib, spec.vcpus, network)
        cands, reason = warm_candidates(views, ask, now, stale)
        tried: list[WarmAttempt] = []
        for cand in cands:
            if len(tried) >= self.config.max_attempts:
                break
            t = cand.contract.template
            wid = self.store.claim_warm(
                sid,
                cand.node.name,
                cand.warm_ids,
                cand.pool.key,
                cand.group_key,
                cand.choice.count,
                time.time(),
                self.config.staleness_s,
                cand.node.locked_mib(t.memory_mib, spec.vcpus, t.pin_memory),
                tenant=spec.tenant,
                accel_class=cand.choice.accel_class,
            )
            if wid is None:
                reason = reason if tried else POOL_EMPTY  # taken by another create since our view
                continue
            row = self._hand_over(sid, spec, cand, wid, tried)
            if row is not None:
                if self.on_path is not None:
                    self.on_path("warm", "")
                return row
            reason = CLAIM_FAILED
        # warm starts on the way are not waited for (docs/decisions.md)
        refilling = warm_refilling(views, ask, now, stale) if reason == POOL_EMPTY else None
        self.store.update_sandbox(sid, "path", detail=ColdPath.of(reason, tried, refilling))
        if self.on_path is not None:
            self.on_path("cold", reason)
        return None

    def _effective_network(self, spec: CreateSpec, resolved: list[Resolved]) -> dict[str, Any] | None:
        """The policy the Cubelet would record (`request_params`): None when the sandbox has no NIC."""
        if not resolved:
            return None
        policy = narrow_network(resolved[0][1].template.sandbox.network, spec.network)
        return policy.to_json() if policy.has_nic else None

    def _hand_over(
        self, sid: str, spec: CreateSpec, cand: WarmCandidate, warm_id: str, tried: list[WarmAttempt]
    ) -> SandboxRow | None:
        contract, node = cand.contract, cand.node
        self.store.update_sandbox(sid, "path", detail=WarmPath(node=node.name, warm_id=warm_id, pool=cand.pool.key))
        placing = self.store.sandbox(sid)
        requested_at = time.time() if placing is None else placing.created_at
        body = WarmClaimBody.model_validate(
            {
                "sandbox_id": sid,
                "count": cand.choice.count,
                "class": cand.choice.accel_class,
                "labels": cand.labels,
                "template": contract.template_name,
                "contract": contract,
                "memory_mib": spec.memory_mib or contract.memory_mib,
                "vcpus": spec.vcpus,
                "workload_token": spec.workload_token,
                "network": spec.network,
                "tenant": spec.tenant,
                "lifetime_s": self._node_lifetime(placing),
                "warm_id": warm_id,
            }
        )
        t0, sent_at = time.perf_counter(), time.time()
        client = self.client(node.cubelet_url)
        try:
            reply = client.claim_warm(body)
        except (CubeError, httpx.HTTPError, ValidationError) as e:  # a malformed 201: outcome unknown, as unreachable
            code = e.code if isinstance(e, CubeError) else "cubelet.unreachable"
            why = e.details.get("reason") if isinstance(e, CubeError) else None
            tried.append(WarmAttempt(node=node.name, warm_id=warm_id, code=code, reason=why, message=str(e)[:300]))
            if not (isinstance(e, CubeError) and e.code == "warm.no_match"):
                # Outcome unknown (unreachable) or torn down: the node lets go of anything under this id.
                with suppress(CubeError, httpx.HTTPError):
                    client.release(sid)
            self.store.update_sandbox(
                sid,
                "warm_claim_refused",
                detail=tried[-1],
                event=SE.REFUSED,
                by=SA.PLACEMENT,
                node=None,
                group_key=None,
                warm_id=None,
            )
            self.cache.invalidate()
            return None
        if reply.access_token is not None:
            self.issued_tokens[sid] = reply.access_token  # passed to the create's caller, never stored
        # as the cold path reads a start's reply: a claimed sandbox that already ended is `failed`, never `starting`
        event, error = _start_outcome(reply)
        self.store.update_sandbox(
            sid,
            "reserved",
            expect=(SS.PLACING,),
            detail=Reserved(
                node=node.name,
                path="warm",
                claim_ms=round((time.perf_counter() - t0) * 1000, 3),
                phases=claim_phases(requested_at, sent_at, time.time(), reply),
                cubelet_timeline=_timeline(reply),
            ),
            event=event,
            by=SA.PLACEMENT,
            device_ids=[] if reply.reservation is None else list(reply.reservation.device_ids),
            accel_class=cand.choice.accel_class,
            count=cand.choice.count,
            template_name=contract.template_name,
            template_version=contract.template_version,
            contract=contract.to_json(),
            cubelet_created_at=None if reply.reservation is None else reply.reservation.created_at,
            error=error,
        )
        self.cache.invalidate()
        row = self.store.sandbox(sid)
        assert row is not None
        return row

    def _node_lifetime(self, row: SandboxRow | None) -> float | None:
        """The Cubelet's backstop: the longest this sandbox may live (set_timeout extends ours)."""
        if row is None:
            return None
        deadline = row.created_at + self._lifetime_cap(row.tenant)
        return max(1.0, deadline - time.time() + LIFETIME_SLACK_S)

    def _lifetime_cap(self, tenant: str) -> float:
        return self.auth.quota(tenant).max_lifetime_s or MAX_LIFETIME_S

    def set_timeout(self, sandbox_id: str, timeout_s: float) -> SandboxRow:
        """Extend (or shorten) a live sandbox's lifetime: it now expires `timeout_s` from now; at expiry the
        maintenance pass deletes it through the release path (event `timeout`). Never past its tenant's maximum
        lifetime counted from creation, which is also what its Cubelet enforces as a backstop."""
        row = self.get(sandbox_id)
        cap = self._lifetime_cap(row.tenant)
        if time.time() + timeout_s > row.created_at + cap:
            raise CubeError(
                "quota.lifetime",
                f"sandbox {sandbox_id} may live at most {cap:g}s from its creation",
                "scheduler",
                {"max_lifetime_s": cap, "requested_s": timeout_s},
            )
        ok = self.store.update_sandbox(
            sandbox_id,
            "timeout_set",
            expect=(SS.STARTING, SS.RUNNING),
            detail=TimeoutSet(timeout_s=timeout_s),
            expires_at=time.time() + timeout_s,
        )
        if not ok:
            raise CubeError("sandbox.not_live", f"sandbox {sandbox_id} is {row.state}: its lifetime is over", "api")
        return self.get(sandbox_id)

    # ---- delete -----------------------------------------------------------------------------------
    def delete(self, sandbox_id: str) -> SandboxRow:
        row = self.get(sandbox_id)
        if row.state in PLACEMENT_STATES:
            if not self.placement_abandoned(row, time.time()):
                raise CubeError("sandbox.busy", f"sandbox {sandbox_id} is being placed; retry", "api")
            # The create that owned it died: whatever it may have reserved is released on the Cubelet.
            self.store.update_sandbox(
                sandbox_id,
                "delete_requested",
                expect=(row.state,),
                detail=AbandonedDelete(abandoned_in=row.state.value),
                event=SE.DELETE,
                by=SA.USER,
            )
            row = self.get(sandbox_id)
        if row.state in (SS.STARTING, SS.RUNNING, SS.DELETING):
            self.store.update_sandbox(
                sandbox_id,
                None if row.state is SS.DELETING else "delete_requested",
                expect=(SS.STARTING, SS.RUNNING, SS.DELETING),
                event=SE.DELETE,
                by=SA.USER,
            )
            self.release(self.get(sandbox_id), by=SA.USER)
        elif row.state in (SS.LOST, SS.FAILED):
            self.store.update_sandbox(sandbox_id, "deleted", event=SE.DELETED, by=SA.USER)
        return self.get(sandbox_id)

    def node_status(
        self,
        node: str,
        sandbox_id: str,
        phase: str,
        error: W.SandboxError | None,
        workload: W.WorkloadCondition | None = None,
    ) -> SandboxState:
        """A Cubelet's push about one of its sandboxes. `starting → running` once the guest validated; a failure
        (at start or later) → `failed` with the Cubelet's code and layer (`error`, which the node is added to);
        a `workload` condition goes on a live sandbox's timeline and changes no state. Only that sandbox's own
        node counts."""
        row = self.get(sandbox_id)
        if row.node != node:
            raise CubeError(
                "sandbox.not_on_node",
                f"sandbox {sandbox_id} is not placed on node {node}",
                "api",
                {"node": row.node},
            )
        if workload is not None:
            self.record_workload(row, workload)
        elif phase == "running":
            self.store.update_sandbox(sandbox_id, "ready", expect=(SS.STARTING,), event=SE.READY, by=SA.CUBELET)
        else:
            self.store.update_sandbox(
                sandbox_id,
                "failed",
                expect=(SS.PLACING, SS.STARTING, SS.RUNNING),
                event=SE.FAIL,
                by=SA.CUBELET,
                error=(W.SandboxError() if error is None else error).model_copy(update={"node": node}),
            )
            self.cache.invalidate()
        state: SandboxState = self.get(sandbox_id).state
        return state

    def record_workload(self, row: SandboxRow, workload: W.WorkloadCondition) -> bool:
        """The node's word on a live sandbox's workload service, on its timeline (`workload_unresponsive` or
        `workload_recovered`) unless the record already says so: a repeated push, or reconcile reading the
        reservation after the push arrived, adds nothing. False when nothing was added."""
        shown = workload_condition(row.state, row.timeline)
        if shown is None if workload.state == "answering" else shown is not None and shown.since == workload.since:
            return False
        said = WorkloadChanged(since=workload.since, reason=workload.reason, message=workload.message)
        entry = WORKLOAD_UNRESPONSIVE if workload.state == "unresponsive" else WORKLOAD_RECOVERED
        return self.store.update_sandbox(row.id, entry, expect=LIVE_STATES, detail=said)

    def placement_abandoned(self, row: SandboxRow, now: float) -> bool:
        return row.state in PLACEMENT_STATES and now - float(row.updated_at) > self.config.placement_stale_s

    def end_revoked(self, tenants: Collection[str], by: SandboxActor) -> list[str]:
        """A revoked tenant's credential reached its sandboxes; they end with it (docs/security.md): each live one
        goes to `deleting` (event `revoked`) and through the ordinary release path, so its node lets go of it and
        its envd token with it. A sandbox still being placed is ended once placement leaves it live (the
        maintenance pass calls this every tick). Returns the ids it ended."""
        ended = []
        for row in self.store.sandboxes(states=(SS.STARTING, SS.RUNNING), tenants=tenants, limit=100_000):
            if self.store.update_sandbox(
                row.id, "tenant_revoked", expect=(SS.STARTING, SS.RUNNING), event=SE.REVOKED, by=by
            ):
                ended.append(row.id)
                self.release(self.get(row.id), by=by)
        return ended

    def release(self, row: SandboxRow, by: SandboxActor = SA.MAINTENANCE) -> None:
        """Ask the node's Cubelet to run its release path; `deleted` only once it says the devices are back."""
        url = self.node_url(row.node)
        try:
            released = self.client(url).release(row.id).released if url else True
        except CubeError as e:
            released = e.code == "reservation.not_found"
        except (httpx.HTTPError, ValidationError) as e:
            self.store.update_sandbox(
                row.id,
                None,
                expect=(SS.DELETING,),
                error=W.SandboxError(code="cubelet.unreachable", message=str(e)[:300]),
            )
            return
        if released:
            self.store.update_sandbox(row.id, "deleted", expect=(SS.DELETING,), event=SE.DELETED, by=by)
            if row.node is not None:  # its devices are free again: that node's claims, not every node's
                self.cache.refresh_node(row.node)
            else:
                self.cache.invalidate()

    def node_url(self, node: str | None) -> str | None:
        if node is None:
            return None
        v = self.cache.view(node)
        return v.cubelet_url if v else None

    def start_phases(self, row: SandboxRow) -> tuple[list[W.StartPhase], bool]:
        """The sandbox's start phases from its node's event journal (VM up, memory pinned, device attached,
        workload service up, guest validated), first of each, in time order; and whether the node answered.
        Through CubeMaster because only CubeMaster holds the node token that the Cubelet's TCP API asks for."""
        url = self.node_url(row.node)
        if url is None:
            return [], False
        try:
            page = self.client(url).events(limit=10000, sandbox_id=row.id)
        except (CubeError, httpx.HTTPError, OSError, ValidationError):
            return [], False
        phases: dict[str, W.StartPhase] = {}
        for e in page.events:
            label = NODE_PHASES.get(str(e.event))
            if label is not None and label not in phases:
                phases[label] = W.StartPhase(phase=label, event=str(e.event), at=e.at)
        return sorted(phases.values(), key=lambda p: p.at), True

    def get(self, sandbox_id: str) -> SandboxRow:
        row = self.store.sandbox(sandbox_id)
        if row is None:
            raise CubeError("sandbox.not_found", f"no sandbox {sandbox_id!r}", "api")
        return row


def _start_outcome(reply: ReservationView) -> tuple[SandboxEvent, W.SandboxError | None]:
    """Ready means ready: `running` only once the Cubelet says the guest validated; a start that already failed
    (and may be released already) is `failed` with the Cubelet's code and layer."""
    res = reply.reservation
    if reply.failure is not None or res is None:
        return SE.FAIL, START_FAILED if reply.failure is None else sandbox_error(reply.failure)
    return (SE.READY if res.phase is ReservationPhase.RUNNING else SE.STARTED), None


def _timeline(reply: ReservationView) -> list[CubeletStep]:
    """The Cubelet's last steps of the start, kept in the sandbox's detail."""
    return reply.timeline[-20:]


def sandbox_error(failure: Failure | W.StatusError) -> W.SandboxError:
    """The Cubelet's failure as the sandbox records it: its fields as the Cubelet sent them."""
    return W.SandboxError.model_validate(failure.model_dump(mode="json"))


def _with_attempts(e: CubeError, attempts: list[ReserveAttempt]) -> CubeError:
    if attempts:
        e.details["attempts"] = [a.model_dump(mode="json") for a in attempts]
    return e


# The node's events that are phases of a start, in the words of issue 12 (`GET /v1/sandboxes/{id}/events`).
NODE_PHASES = {
    "vm_started": "VM up",
    "memory_pinned": "memory pinned",
    "device_attached": "device attached",
    "workload_ready": "workload service up",
    "guest_validated": "guest validated",
}


def sandbox_record(
    row: SandboxRow, model: type[SandboxT], silent_nodes: Collection[str] = (), **extra: Any
) -> SandboxT:
    """The reply's record of a stored sandbox (`model`: `Sandbox`, or a reply that adds `extra` fields).
    `silent_nodes`: nodes whose heartbeats are stale (master/node_truth.py); their live sandboxes show `unknown`,
    with the stored state in `last_known_state`."""
    state, last_known = shown_state(row.state, row.node, silent_nodes)
    template = None
    if row.template_name is not None:
        template = W.SandboxTemplate(name=row.template_name, version=row.template_version, digest=row.template_digest)
    return model(
        id=row.id,
        tenant=row.tenant,
        state=state,
        last_known_state=last_known,
        workload=workload_condition(row.state, row.timeline),
        node=row.node,
        accel_class=row.accel_class,
        count=row.count,
        device_ids=list(row.device_ids),
        template=template,
        request=row.request,
        error=row.error,
        timeline=list(row.timeline),
        expires_at=row.expires_at,
        created_at=row.created_at,
        updated_at=row.updated_at,
        **extra,
    )
