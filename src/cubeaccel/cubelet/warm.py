"""Warm sandboxes (docs/warm.md): per pool key, a configured number of sandboxes started through the normal path
and owned by the node, and the claim that hands one to a requester.

A pool's key is the reservation's recorded parameters that decide what the sandbox *is* — the frozen contract's
digest, device count and class, labels, memory, vCPUs, pinning and the effective network policy — derived by
`Cubelet.request_params` for a pool and for a claim alike, so a claim matches exactly the requests a cold start
would have recorded the same way. Lifetime, tenant and template name are bound at the claim.

A claim is one compare-and-swap in the journal (`Tx.claim_reservation`: the warm row, by its phase, becomes the
requester's sandbox id, with its devices), then the hand-off to the shim (`ShimClaim` on its control socket).
Crash rule: the journal decides, and a claimed reservation belongs to its requester. One whose shim never
acknowledged the claim (`claim_acked` false, no claim in flight in this process) is failed through the release
path by reconcile (`warm.claim_unacknowledged`), never put back in the pool: the tenant's token may have reached
the guest, and a sandbox a tenant could have reached is never handed to another.

The pools and the drain are one record in the journal (`WarmSettings`), so a restarted Cubelet keeps both.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import threading
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import ValidationError

from cubeaccel.cubelet.capacity_wait import CAPACITY_CODES, CapacityWaits
from cubeaccel.cubelet.release import CubeletConfig
from cubeaccel.cubelet.sandbox_ids import token_digest, validate_sandbox_id
from cubeaccel.cubelet.shim_driver import ShimDriver
from cubeaccel.cubelet.store import Reservation, Store, Tx
from cubeaccel.model.event_kinds import EventKind
from cubeaccel.model.reservation_params import ReservationParams
from cubeaccel.model.reservation_states import ReservationEvent, ReservationPhase
from cubeaccel.model.states import Actor
from cubeaccel.protocol.errors import CubeError, conflict
from cubeaccel.wire.warm import WARM_ID_PREFIX, ShimClaim, ShimClaimAck, WarmPoolSetting, WarmPoolView, WarmSettings

log = logging.getLogger(__name__)
P, RE = ReservationPhase, ReservationEvent
WARM_PREFIX = WARM_ID_PREFIX  # a warm sandbox's own id (its shim, VMM and run directory keep it after a claim)
BACKOFF_FIRST_S = 2.0
BACKOFF_MAX_S = 300.0
DRAINED = "warm.drained"  # teardown reason and miss reason while the node's pools are drained
NO_POOL = "warm.no_pool"  # miss reason, and teardown reason of a warm sandbox no configured pool keeps
SUPERSEDED = "warm.superseded"  # teardown reason: its pool was replaced by another version of its template
SETTINGS_KEY = "warm"  # the journal's `meta` row holding `WarmSettings`
CLAIM_TIMEOUT_S = 40.0  # the shim's rebind waits up to 30 s for the guest's new session
# Labels are not in the key: they narrow which devices qualify, so a claim checks the warm sandbox's devices.
KEY_FIELDS = ("count", "class", "memory_mib", "vcpus", "pin_memory", "network")


def pool_key(params: ReservationParams) -> str:
    """What a warm sandbox is, as one string: readable head, digest of every deciding field."""
    digest = "none" if params.contract is None else params.contract.digest
    recorded = params.to_json()
    shape = {k: recorded.get(k) for k in KEY_FIELDS}
    h = hashlib.sha256(json.dumps({"contract": digest, **shape}, sort_keys=True).encode()).hexdigest()
    return f"{digest.removeprefix('sha256:')[:12]}-{params.memory_mib}m{params.vcpus}c-{h[:12]}"


def refuse_reserved_id(sandbox_id: str) -> str:
    """A requester's id (a claim's, a reservation's over the API) may not be in the node's own namespace: an id
    a warm sandbox holds, or will, is never a requester's to name, reserve or have released."""
    if sandbox_id.startswith(WARM_PREFIX):
        raise conflict("warm.reserved_id", f"ids starting {WARM_PREFIX!r} are the node's own", layer="cubelet")
    return sandbox_id


def supersedes(new: Any, old: Any) -> bool:
    """Whether a pool of request `new` replaces the pool of `old`: the same template by name and the same shape a
    pool is asked for by (class, count, vCPUs), another document (a new version, or the same one edited). Memory
    and pinning are the template's, so they may change with it. A pool without a contract is never replaced."""
    if new.contract is None or old.contract is None:
        return False
    shape = (new.contract.template_name, new.accel_class, new.count, new.vcpus)
    same = shape == (old.contract.template_name, old.accel_class, old.count, old.vcpus)
    return same and new.contract.digest != old.contract.digest


def _never_fits(refusal: CubeError, count: int) -> bool:
    """A pool asking for more devices than the node has at all: no release makes room, so it is a failure."""
    by_state = refusal.details.get("devices_by_state")
    return isinstance(by_state, dict) and sum(by_state.values()) < count


class WarmHost(Protocol):
    """What the pool needs of the Cubelet (lifecycle.Cubelet; a protocol, so this module does not import it)."""

    store: Store
    shim: ShimDriver
    config: CubeletConfig
    capacity_waits: CapacityWaits

    def request_params(self, req: Any) -> tuple[Any, ReservationParams]: ...

    def pool_request(self, shape: WarmPoolSetting) -> Any: ...

    def reserve(
        self, sandbox_id: str, req: Any, capacity_wait_s: float = 0.0, yield_to_waiting: bool = False
    ) -> Reservation: ...

    def start(self, sandbox_id: str, token: str | None = None, warm_pool: str | None = None) -> Reservation | None: ...

    def change(self) -> AbstractContextManager[Tx]: ...

    def begin_teardown(
        self, sandbox_id: str, reason: str, attach_failed: bool = False, layer: str = "cubelet", message: str = ""
    ) -> None: ...


@dataclass
class Pool:
    key: str
    request: Any  # lifecycle.ReservationRequest: the shape, without tenant or lifetime
    size: int
    claims: int = 0
    misses: int = 0
    failures: int = 0
    backoff_s: float = 0.0
    retry_at: float = 0.0
    # A start refused for capacity (no free device, no lockable memory, a device owed to a waiting create): the
    # refusal's code and the node's capacity-change count then. Not a failure, never backed off: the refill
    # retries once capacity changed (a device allocatable again); for lockable memory, which the host may free
    # without the journal seeing it, also every 2 s.
    waiting_for: str | None = None
    waiting_mark: int = 0
    refill_s: list[float] = field(default_factory=list)  # the last warm starts' durations
    refills: int = 0  # warm starts that became warm, and their total time (metrics: a summary)
    refill_total_s: float = 0.0


class WarmPools:
    def __init__(self, cubelet: WarmHost, max_concurrent_starts: int = 1) -> None:
        self.cubelet = cubelet
        self.max_concurrent_starts = max(1, max_concurrent_starts)
        self.pools: dict[str, Pool] = {}
        self.claiming: set[str] = set()  # sandbox ids whose claim is being handed to the shim now
        self.misses_by_reason: dict[str, int] = {}  # the node's claim misses (a `warm.no_pool` one has no pool)
        self._inflight: dict[str, str] = {}  # warm id → pool key, while this process reserves and starts it
        self._cv = threading.Condition()
        self._stopped = False
        self.draining = False  # drain or `down`: no refill, no claim, the unclaimed ones torn down
        self._thread: threading.Thread | None = None
        cubelet.capacity_waits.wakers.append(self.poke)  # a device back: a pool waiting for one refills now

    # ---- configuration -------------------------------------------------------------------------------------
    def set_pool(self, req: Any, size: int) -> Pool:
        """Keep `size` warm sandboxes of `req`'s shape (validated as a reservation would be); 0 stops refilling
        (the warm ones stay until claimed or the node is drained). A pool of another version of the same
        template and shape is superseded: dropped, and its unclaimed warm sandboxes released at once, since no
        create that resolves the template to this version can claim them."""
        _, params = self.cubelet.request_params(req)
        key = pool_key(params)
        with self.cubelet.change() as t:
            with self._cv:
                superseded = [k for k, p in self.pools.items() if k != key and supersedes(req, p.request)]
                for k in superseded:
                    del self.pools[k]
                pool = self.pools.get(key)
                if pool is None:
                    pool = self.pools[key] = Pool(key, req, size)
                pool.size = size
                pool.backoff_s, pool.retry_at, pool.waiting_for = 0.0, 0.0, None
                self._save(t)
                self._cv.notify_all()
            details = {"pool": key, "size": size, "template": req.template, "superseded": superseded}
            t.event(EventKind.WARM_POOL_SET, Actor.CUBELET, details=details)
        for k in superseded:
            self._retire(k)
        return pool

    def _retire(self, key: str) -> list[str]:
        """Release the unclaimed warm sandboxes (warm or starting) of a superseded pool; a warm start of it still
        in flight ends as an orphan, which reconcile releases (`orphans`)."""
        ids = [
            r.sandbox_id
            for r in self.cubelet.store.reservations()
            if r.checkpoint.warm_pool == key and r.checkpoint.claimed_at is None and r.phase is not P.RELEASING
        ]
        for sid in ids:
            self.cubelet.begin_teardown(sid, SUPERSEDED, message="its warm pool's template has a newer version here")
        return ids

    # ---- the journal's record: pools and drain outlive this process ------------------------------------------
    def _save(self, t: Tx) -> None:
        """Under `_cv`, inside the change that made the difference: the record is never behind what was said."""
        settings = WarmSettings(
            draining=self.draining,
            pools=[
                WarmPoolSetting.model_validate(
                    {
                        "size": p.size,
                        "count": p.request.count,
                        "class": p.request.accel_class,
                        "memory_mib": p.request.memory_mib,
                        "vcpus": p.request.vcpus,
                        "pin_memory": p.request.pin_memory,
                        "contract": None if p.request.contract is None else p.request.contract.to_json(),
                        "template": p.request.template,
                    }
                )
                for p in self.pools.values()
            ],
        )
        t.set_meta(SETTINGS_KEY, settings.model_dump_json(by_alias=True))

    def restore(self) -> None:
        """The pools and drain the journal kept. A record this build cannot read leaves the node drained (no
        refill, no claim) and says so, rather than guess; a pool whose shape no longer validates is skipped."""
        with self.cubelet.store.read() as t:
            raw = t.meta(SETTINGS_KEY)
        if raw is None:
            return
        try:
            settings = WarmSettings.model_validate_json(raw)
        except ValidationError as e:
            log.error("warm settings unreadable, the node stays drained: %s", e)
            self.draining = True
            self._event(EventKind.WARM_SETTINGS_UNREADABLE, None, "warm.drained", {"error": str(e)[:500]})
            return
        self.draining = settings.draining
        for shape in settings.pools:
            try:
                req = self.cubelet.pool_request(shape)
                _, params = self.cubelet.request_params(req)
            except CubeError as e:
                self._event(
                    EventKind.WARM_POOL_DROPPED, None, e.code, {"template": shape.template, "message": e.message}
                )
                continue
            key = pool_key(params)
            self.pools[key] = Pool(key, req, shape.size)

    def reset(self) -> None:
        """No pools, not drained, in the journal too: a start that brings its whole warm config (`up`)."""
        with self.cubelet.change() as t, self._cv:
            self.pools.clear()
            self.draining = False
            self._save(t)
            t.event(EventKind.WARM_RESET, Actor.CUBELET, details={})

    def orphans(self) -> list[str]:
        """Unclaimed warm sandboxes of no pool kept here (their pool's shape no longer validates): the refill
        will never count them and no claim can match them, so reconcile releases them."""
        with self._cv:
            known, busy = set(self.pools), set(self._inflight)
        return [
            r.sandbox_id
            for r in self.cubelet.store.reservations()
            if r.checkpoint.warm_pool is not None
            and r.checkpoint.claimed_at is None
            and r.checkpoint.warm_pool not in known
            and r.phase is not P.RELEASING
            and r.sandbox_id not in busy
        ]

    def _event(self, kind: EventKind, sandbox_id: str | None, reason: str | None, details: dict[str, Any]) -> None:
        with self.cubelet.change() as t:
            t.event(kind, Actor.CUBELET, sandbox_id=sandbox_id, reason=reason, details=details)

    # ---- counts --------------------------------------------------------------------------------------------
    def counts(self, key: str) -> tuple[int, int]:
        """(warm, starting) of one pool: from the journal, plus what this process is starting right now."""
        warm = starting = 0
        for r in self.cubelet.store.reservations():
            if r.checkpoint.warm_pool != key or r.checkpoint.claimed_at is not None:
                continue
            if r.phase is P.WARM:
                warm += 1
            elif r.phase in (P.RESERVED, P.STARTING) and r.sandbox_id not in self._inflight:
                starting += 1
        with self._cv:
            starting += sum(1 for k in self._inflight.values() if k == key)
        return warm, starting

    def views(self) -> list[WarmPoolView]:
        out = []
        for pool in list(self.pools.values()):
            warm, starting = self.counts(pool.key)
            out.append(
                WarmPoolView(
                    key=pool.key,
                    template=pool.request.template,
                    size=pool.size,
                    warm=warm,
                    starting=starting,
                    claims=pool.claims,
                    misses=pool.misses,
                    failures=pool.failures,
                    backoff_s=pool.backoff_s,
                    waiting_for=pool.waiting_for,
                )
            )
        return out

    # ---- refill --------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="warm refill", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()

    def poke(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cv:
                if self._stopped:
                    return
            try:
                self.refill_once()
            except Exception:  # the loop outlives one bad pass; the next tick tries again
                log.exception("warm refill pass failed")
            with self._cv:
                if not self._stopped:
                    self._cv.wait(1.0)

    def refill_once(self) -> list[str]:
        """Start what the pools lack, within the bound on concurrent starts; returns the warm ids started."""
        started: list[str] = []
        now = time.monotonic()
        if self.draining:
            return started
        for pool in list(self.pools.values()):
            warm, starting = self.counts(pool.key)
            with self._cv:
                busy = len(self._inflight)
            if pool.size - warm - starting <= 0 or now < pool.retry_at or busy >= self.max_concurrent_starts:
                continue
            if pool.waiting_for == "reserve.insufficient_devices" and (
                pool.waiting_mark == self.cubelet.capacity_waits.changes
            ):
                continue  # no device came back since the last refusal
            sid = WARM_PREFIX + secrets.token_hex(8)
            with self._cv:
                self._inflight[sid] = pool.key
            threading.Thread(target=self._warm_one, args=(pool, sid), name=f"warm {sid}", daemon=True).start()
            started.append(sid)
        return started

    def _warm_one(self, pool: Pool, sid: str) -> None:
        """Reserve → start (the normal path) → wait until it is warm or gone; a failure backs the pool off."""
        t0 = time.monotonic()
        ok = False
        waits = None  # the capacity refusal's code, when that is why this start did not happen
        mark = self.cubelet.capacity_waits.changes  # read before the attempt: a change during it is not missed
        try:
            try:
                self.cubelet.reserve(sid, pool.request, yield_to_waiting=True)
            except CubeError as e:
                if not e.code.startswith(CAPACITY_CODES) or _never_fits(e, pool.request.count):
                    raise
                waits = e.code
                return
            pool.waiting_for = None
            if self.draining:  # the drain's scan may have run before this reservation existed
                self.cubelet.begin_teardown(sid, DRAINED, message="the node's warm pools are drained")
                return
            self.cubelet.start(sid, warm_pool=pool.key)
            deadline = t0 + self.cubelet.config.startup_timeout_s + 60
            while time.monotonic() < deadline:
                res = self.cubelet.store.reservation(sid)
                if res is None or res.phase is P.RELEASING:
                    break
                if res.phase is P.WARM:
                    ok = True
                    break
                with self._cv:
                    if self._stopped:
                        break
                    self._cv.wait(0.2)
        except CubeError as e:
            self._event(EventKind.WARM_START_FAILED, sid, e.code, {"pool": pool.key})
        finally:
            with self._cv:
                self._inflight.pop(sid, None)
                if waits is not None:
                    pool.waiting_for, pool.waiting_mark = waits, mark
                    if waits != "reserve.insufficient_devices":  # lockable memory: the host's, freed unseen too
                        pool.retry_at = time.monotonic() + BACKOFF_FIRST_S  # so also looked at again, not doubled
                elif ok:
                    pool.backoff_s, pool.retry_at = 0.0, 0.0
                    took = time.monotonic() - t0
                    pool.refill_s = [*pool.refill_s[-9:], round(took, 3)]
                    pool.refills, pool.refill_total_s = pool.refills + 1, pool.refill_total_s + took
                elif not self.draining:  # a start the drain ended is not the pool's failure
                    pool.failures += 1
                    pool.backoff_s = min(BACKOFF_MAX_S, pool.backoff_s * 2 or BACKOFF_FIRST_S)
                    pool.retry_at = time.monotonic() + pool.backoff_s
                self._cv.notify_all()

    # ---- drain -------------------------------------------------------------------------------------------------
    def drain(self) -> list[str]:
        """Stop refilling and claiming, and tear down every unclaimed warm sandbox (warm or still starting)
        through the release path; returns their ids. A drained node's tenants are left to their owners."""
        with self.cubelet.change() as t, self._cv:
            self.draining = True
            self._save(t)
            self._cv.notify_all()
        ids = [
            r.sandbox_id
            for r in self.cubelet.store.reservations()
            if r.checkpoint.warm_pool is not None and r.checkpoint.claimed_at is None and r.phase is not P.RELEASING
        ]
        for sid in ids:
            self.cubelet.begin_teardown(sid, DRAINED, message="the node's warm pools are drained")
        self._event(EventKind.WARM_DRAINED, None, None, {"torn_down": ids})
        return ids

    def undrain(self) -> None:
        with self.cubelet.change() as t:
            with self._cv:
                self.draining = False
                for pool in self.pools.values():
                    pool.backoff_s, pool.retry_at, pool.waiting_for = 0.0, 0.0, None
                self._save(t)
                self._cv.notify_all()
            t.event(EventKind.WARM_UNDRAINED, Actor.CUBELET, details={})

    # ---- claim ---------------------------------------------------------------------------------------------
    def miss(self, key: str | None, reason: str) -> CubeError:
        with self._cv:
            if key is not None and (pool := self.pools.get(key)) is not None:
                pool.misses += 1
            self.misses_by_reason[reason] = self.misses_by_reason.get(reason, 0) + 1
        return conflict(
            "warm.no_match", f"no warm sandbox matches ({reason})", layer="cubelet", details={"reason": reason}
        )

    def claim(
        self, sandbox_id: str, req: Any, given: str | None = None, warm_id: str | None = None
    ) -> tuple[Reservation, str, ShimClaimAck]:
        """The requester's sandbox from a warm one, or `warm.no_match` (409, `details.reason` names the miss:
        `warm.no_pool`, `warm.pool_empty`). `warm_id`: only that warm sandbox (CubeMaster names the one its
        claim row holds); a miss when it is no longer warm. Returns the reservation, the token it serves and the
        shim's ack (the hand-off's timing)."""
        refuse_reserved_id(validate_sandbox_id(sandbox_id))
        _, params = self.cubelet.request_params(req)
        key = pool_key(params)
        if key not in self.pools:
            raise self.miss(None, NO_POOL)
        if self.draining:
            raise self.miss(key, DRAINED)
        token = given or secrets.token_urlsafe(32)
        with self.cubelet.change() as t:
            if self.draining:  # again under the lock: a drain that began meanwhile tears these down, one by one
                raise self.miss(key, DRAINED)
            if t.reservation(sandbox_id) is not None:
                raise conflict("reserve.sandbox_conflict", f"sandbox {sandbox_id} already holds a reservation")
            warm = [
                r
                for r in t.reservations()
                if r.phase is P.WARM
                and r.checkpoint.warm_pool == key
                and warm_id in (None, r.sandbox_id)
                and all(d.labels.get(k) == v for d in t.devices_of(r.sandbox_id) for k, v in req.labels)
            ]
            if not warm:
                raise self.miss(key, "warm.pool_empty")
            w = warm[0]  # the oldest
            cp = w.checkpoint
            cp.shim_id, cp.claimed_at, cp.started_at = w.shim_id, t.now, t.now  # the lifetime runs from the claim
            cp.workload_token_sha256 = token_digest(token)
            claimed = Reservation(sandbox_id, params, w.device_ids, w.phase, w.created_at, None, cp)
            claimed.fire(RE.CLAIM)
            if not t.claim_reservation(w.sandbox_id, claimed):  # cannot happen under the lock; the CAS says so
                raise self.miss(key, "warm.pool_empty")
            details = {"pool": key, "warm_id": w.sandbox_id, "tenant": req.tenant, "path": "warm"}
            t.event(EventKind.WARM_CLAIMED, Actor.CUBELET, sandbox_id=sandbox_id, details=details)
            t.event(
                EventKind.WARM_CLAIMED, Actor.CUBELET, sandbox_id=w.sandbox_id, details={**details, "as": sandbox_id}
            )
            custody = {
                "warm_id": w.sandbox_id,
                "tenant": req.tenant,
                "template": req.template,
                "contract_digest": None if params.contract is None else params.contract.digest,
            }
            for device_id in w.device_ids:  # the custody record names the claimer from this instant on
                t.event(
                    EventKind.DEVICE_CLAIMED, Actor.CUBELET, device_id=device_id, sandbox_id=sandbox_id, details=custody
                )
            with self._cv:
                self.claiming.add(sandbox_id)
                self.pools[key].claims += 1
        try:
            res, ack = self._hand_off(claimed, token)
            return res, token, ack
        finally:
            with self._cv:
                self.claiming.discard(sandbox_id)
                self._cv.notify_all()  # the refill starts the next one

    def _hand_off(self, res: Reservation, token: str) -> tuple[Reservation, ShimClaimAck]:
        msg = ShimClaim(sandbox_id=res.sandbox_id, workload_token=token, rng_seed=secrets.token_hex(32))  # type: ignore[arg-type]
        ack = self.cubelet.shim.claim(res.shim_id, msg, CLAIM_TIMEOUT_S)
        if not ack.ok:
            code = ack.code or "warm.claim_unanswered"
            self.cubelet.begin_teardown(res.sandbox_id, code, layer="cubelet", message=ack.message)
            raise CubeError(code, f"the warm sandbox did not take the claim: {ack.message}", "cubelet", {}, 503)
        with self.cubelet.change() as t:
            cur = t.reservation(res.sandbox_id)
            if cur is None or cur.phase is not P.RUNNING:
                raise conflict("sandbox.releasing", f"sandbox {res.sandbox_id} ended during its claim")
            cur.checkpoint.claim_acked = True
            t.update_reservation(cur)
            t.event(
                EventKind.WARM_CLAIM_ACKED,
                Actor.CUBELET,
                sandbox_id=res.sandbox_id,
                details={"reseed_ms": ack.reseed_ms, "rebind_ms": ack.rebind_ms, "reseeded": ack.reseeded},
            )
            return cur, ack

    def unacknowledged(self) -> list[str]:
        """Claimed reservations whose shim never took the claim and whose claim is not in flight here."""
        with self._cv:
            busy = set(self.claiming)
        return [
            r.sandbox_id
            for r in self.cubelet.store.reservations()
            if r.phase is P.RUNNING
            and r.checkpoint.claimed_at is not None
            and not r.checkpoint.claim_acked
            and r.sandbox_id not in busy
        ]
