"""The release path: teardown, the release rules on host evidence, revalidation, expiry.

The design's release rules, on host evidence at the moment of release, for every backend: the VMM process
exited (no live process carries the sandbox's tag), the shim exited or its final release report arrived,
nothing holds the device's files (an fd we cannot read is an unknown holder), and cleanup (reset) succeeded;
then revalidation. A confirmed detach is recorded but replaces none of these. Anything unproven past the
timeouts is quarantined. Reports from the shim are recorded elsewhere; here only host evidence counts.

To follow one release: `ReleasePath.begin_teardown` (entered from `Cubelet.release`, a shim report or reconcile)
→ `try_release` → `_vmm_evidence` (rules 1 and 2) → `_release_device` → `_judge_release` (`_blocked`,
`_reclaim_nodes`, `reset_device`, `_evidence`) → `_apply_outcome` (the one `release_confirmed` transition) →
`advance_scrub` → `_finish_scrub` → `_finish_revalidation` → `_close_reservation`. What each step is given was
decided in one place, `cubelet/runtime.py::assemble`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from cubeaccel.backends.base import Backend, Capabilities, Problem, ResetContext
from cubeaccel.backends.scrub_methods import method_for
from cubeaccel.cubelet.ended import EndedSandboxes, status_error
from cubeaccel.cubelet.journal import Journal
from cubeaccel.cubelet.locks import KeyedLocks
from cubeaccel.cubelet.memory_ledger import VmmHost
from cubeaccel.cubelet.scrub import (
    DEFAULT_POLICY,
    ScrubOutcome,
    ScrubPolicy,
    ScrubRunner,
    policy_for,
    refusal,
    scrub_method_name,
    scrub_needs_vm,
)
from cubeaccel.cubelet.shim_driver import ShimDriver, ShimStatus
from cubeaccel.cubelet.store import Reservation, Store, Tx
from cubeaccel.host.pci.base import Holder
from cubeaccel.host.service.audit import AuditLog
from cubeaccel.model.checkpoint import SandboxFailure
from cubeaccel.model.device import DeviceRecord
from cubeaccel.model.event_kinds import EventKind
from cubeaccel.model.reservation_states import ReservationEvent, ReservationPhase
from cubeaccel.model.reset_ladder import ResetAttempt
from cubeaccel.model.states import TENANT_STATES, Actor, DeviceEvent, DeviceState
from cubeaccel.protocol.errors import CubeError
from cubeaccel.wire.master_api import StatusBody

S, E = DeviceState, DeviceEvent
P, RE = ReservationPhase, ReservationEvent
SCRUB_PENDING = "release.scrub_pending"  # a released device's reason while its scrub is owed or running
USER_RELEASE = "sandbox_deleted"  # the one teardown reason that is not a failure of the sandbox
StatusSink = Callable[[str, StatusBody], None]  # (sandbox id, its status) → CubeMaster


@dataclass(frozen=True)
class CubeletConfig:
    node_name: str = "node-1"
    reservation_ttl_s: float = 300.0  # a reservation whose sandbox never starts expires
    default_lifetime_s: float = 24 * 3600.0  # a started sandbox that named no lifetime is torn down after this
    release_timeout_s: float = 30.0  # how long release may wait for VMM exit / holders before quarantine
    warm_max_concurrent_starts: int = 1  # warm sandboxes started at once by the refill (docs/warm.md)
    startup_timeout_s: float = 180.0  # a shim that has not started its VMM by then is torn down (more for large guests)
    kill_grace_s: float = 10.0  # after SIGKILL, how long a VMM (many GiB pinned) may take to be reaped
    pinnable_memory_mib: int | None = None  # lockable guest memory to advertise; None: MemAvailable
    vmm_host: VmmHost | None = None  # what shapes a VMM's locked memory here; None: read from this host
    # Sandbox networks (host/net/netpolicy.py): each sandbox's veth /30 comes from `network_pool`; its uplink end goes
    # into `network_uplink_netns` (None: the host's namespace, where the operator routes the pool onward).
    network_pool: str = "100.96.0.0/16"
    network_uplink_netns: str | None = None
    # Host directories templates may show read-only in guests (`spec.sandbox.filesystem.readonly_mounts`).
    readonly_mount_allowlist: tuple[str, ...] = ()
    # A real shim's VMM gets no device until Cubelet has read its confinement from /proc (docs/security.md); off
    # only for a stand-in shim that starts QEMU itself (the VFIO lab).
    require_vmm_confinement: bool = True
    scrub_policy: dict[str, ScrubPolicy] = field(default_factory=lambda: dict(DEFAULT_POLICY))  # per device class
    scrub_timeout_s: float = 600.0  # boot + zero + verify + teardown of the scrub VM, else quarantine


def problem_event(problems: list[Problem]) -> tuple[DeviceEvent, str]:
    """Hard problems make a device unhealthy; anything softer means safety is unproven: quarantine. Only held
    ones take an allocatable device back to `initialized` (`record_problems`)."""
    if problems and all(p.held for p in problems):
        return E.HOST_NOT_READY, problems[0].code
    hard = [p for p in problems if p.hard]
    first = (hard or problems)[0]
    return (E.HEALTH_FAILED if hard else E.QUARANTINE), first.code


def record_problems(t: Tx, d: DeviceRecord, problems: list[Problem], **extra: Any) -> DeviceRecord:
    """The one way a device that failed a check leaves service: unhealthy or quarantined, with its reasons.

    Only held problems (`Problem.held`) on a device no tenant has: it stays (or goes back to) `initialized` with
    the reason, as on a host that is not ready (a released device gets there through revalidation); anywhere else
    they count as soft (quarantine)."""
    details = {"problems": [p.__dict__ for p in problems], **extra}
    if problems and all(p.held for p in problems):
        reason = problems[0].code
        if d.state is S.INITIALIZED:
            if d.reason != reason:
                t.set_reason(d, reason)
            return t.device(d.id) or d
        if d.state is S.ALLOCATABLE:
            return t.transition(d, E.HOST_NOT_READY, Actor.CUBELET, reason=reason, details=details)
        problems = [Problem(p.code, p.message, hard=False) for p in problems]  # anywhere else: safety unproven
    event, reason = problem_event(problems)
    return t.transition(d, event, Actor.CUBELET, reason=reason, details=details)


def sandbox_devices(t: Tx, sandbox_id: str) -> list[DeviceRecord]:
    """Devices of the sandbox's *current* reservation: a quarantined device keeps its last tenant's id for
    forensics, and a sandbox id may be reused, so membership is the reservation's device list."""
    res = t.reservation(sandbox_id)
    ids = set(res.device_ids) if res is not None else set()
    return [d for d in t.devices_of(sandbox_id) if d.id in ids]


@dataclass(frozen=True)
class HostEvent:
    """A change to the sandbox's own host state (its files, its network), for the event trail."""

    kind: EventKind
    reason: str | None
    details: dict[str, Any]  # the event's details, as the trail keeps them


@dataclass(frozen=True)
class Blocking:
    """The host evidence a device was held on: its holders, the VMM, the shim, the detach."""

    holders: tuple[Holder, ...]
    vmm_pid: int | None
    shim_alive: bool | None
    detach_confirmed: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "holders": [h.__dict__ for h in self.holders],
            "vmm_pid": self.vmm_pid,
            "shim_alive": self.shim_alive,
            "detach_confirmed": self.detach_confirmed,
        }


@dataclass(frozen=True)
class Hold:
    """A release rule that is not met: its code (the device's reason), and what the host showed."""

    reason: str
    blocking: Blocking | None = None
    problems: tuple[Problem, ...] = ()  # device nodes not taken back from the tenant's uid

    def details(self) -> dict[str, Any] | None:
        if self.blocking is not None:
            return self.blocking.to_json()
        return {"problems": [p.__dict__ for p in self.problems]} if self.problems else None


@dataclass(frozen=True)
class ReleaseEvidence:
    """Every release rule met, as the `release_confirmed` transition records it (model/sanitize.py reads the
    scrub fields back from the trail). The VMM exited, no holder and the reset passed are implied: recorded as
    constants, as they always were."""

    shim_exited: bool
    shim_final_report: bool
    detach_confirmed: bool
    reset_ladder: tuple[ResetAttempt, ...] | None  # None: the backend has no ladder (its `cleanup` ran)
    scrub_owed: bool  # a device no VMM of the tenant's ever had holds nothing of theirs
    scrub_policy: ScrubPolicy  # recorded, not implied: the sanitizing stage this release relies on
    scrub_method: str | None
    vmm_started: bool

    def to_json(self) -> dict[str, Any]:
        ladder = {} if self.reset_ladder is None else {"reset_ladder": [a.to_json() for a in self.reset_ladder]}
        return {
            "vmm_exited": True,
            "shim_exited": self.shim_exited,
            "shim_final_report": self.shim_final_report,
            "detach_confirmed": self.detach_confirmed,
            "holders": 0,
            "reset": True,
            **ladder,
            "scrub_owed": self.scrub_owed,
            "scrub_policy": self.scrub_policy.value,
            "scrub_method": self.scrub_method,
            "vmm_started": self.vmm_started,
        }


@dataclass(frozen=True)
class ReleaseOutcome:
    """What the host work on one device found, applied later in one transaction. At most one of the first
    three; none of them means cleanup succeeded (`evidence` when it was a release) and `revalidation` decides."""

    quarantine: Hold | None = None
    waiting: Hold | None = None
    cleanup: list[Problem] | None = None
    evidence: ReleaseEvidence | None = None
    revalidation: list[Problem] | None = None


@dataclass
class ScrubJob:
    """One scrub of one device in `released`, for the record generation it started from. In memory only: after a
    restart a `released` device that owes a scrub simply gets a new one (scrubbing twice is safe; skipping is not)."""

    generation: int
    started: float
    outcome: ScrubOutcome | None = None


class ReleasePath:
    """The release path of one node, built by the composition root (`cubelet/runtime.py`) with what it uses: the
    journal (store, lifecycle lock, audit settle), the backend and its capabilities, the shim driver, the scrub
    runner, the per-device locks, the record of sandboxes this process ended, the status sink towards CubeMaster
    and the host audit log. The Cubelet hands it teardowns; nothing here reads the Cubelet.

    Order of the release path, per device: VMM (and shim) exited → no holder → cleanup (reset) →
    `release_confirmed` (released) → scrub, where the class's policy asks for one (scrub VM, then reset again)
    → revalidation → allocatable. Steps other releases add (VFIO group hand-back, network and scratch teardown)
    come before `release_confirmed`: the scrub VM gets a device nothing of the tenant's still touches."""

    def __init__(
        self,
        journal: Journal,
        backend: Backend,
        capabilities: Capabilities,
        shim: ShimDriver,
        config: CubeletConfig,
        *,
        device_locks: KeyedLocks,
        ended: EndedSandboxes,
        scrub_runner: ScrubRunner,
        status_sink: StatusSink | None = None,
        audit: AuditLog | None = None,
    ) -> None:
        """`status_sink`: None on a node with no CubeMaster to tell. `audit`: None on a node built without an
        audit log (unit tests); a served node always has one."""
        self.journal = journal
        self.store: Store = journal.store
        self.lock: threading.RLock = journal.lock
        self.backend = backend
        self.capabilities = capabilities
        self.shim = shim
        self.config = config
        self.device_locks = device_locks
        self.ended = ended
        self.scrub_runner = scrub_runner
        self.status_sink = status_sink
        self.audit = audit
        self.scrubs: dict[str, ScrubJob] = {}
        # image stack → why its scrub VM cannot boot here (scrub_ready.py); none known until host initialization
        self.scrub_image_problems: dict[str, Problem] = {}

    def change(self) -> AbstractContextManager[Tx]:
        """One lifecycle decision: under the lifecycle lock, in one transaction, durable on return."""
        return self.journal.change()

    def set_scrub_image_problems(self, problems: dict[str, Problem]) -> None:
        """The last readiness check's answer (scrub_ready.py), read by `scrub_refusal`."""
        self.scrub_image_problems = dict(problems)

    @staticmethod
    def _sandbox_devices(t: Tx, sandbox_id: str) -> list[DeviceRecord]:
        return sandbox_devices(t, sandbox_id)

    def notify(self, sandbox_id: str, status: StatusBody) -> None:
        """Tell CubeMaster at once (ready, or failed with code and layer); never blocks the lifecycle."""
        if self.status_sink is not None:
            self.status_sink(sandbox_id, status)

    def begin_teardown(
        self, sandbox_id: str, reason: str, attach_failed: bool = False, layer: str = "cubelet", message: str = ""
    ) -> None:
        """Enter `releasing` before any cleanup starts, then ask the shim to stop and try to release.

        Any reason but a user's delete is a failure of the sandbox: recorded in the reservation (`failure`,
        with code and layer, kept in the `reservation_closed` event) and pushed to CubeMaster. The lifecycle
        lock covers only the transaction: stopping the shim and the release itself are host work."""
        with self.change() as t:
            res = t.reservation(sandbox_id)
            if res is None:
                return
            first = res.phase is not P.RELEASING
            unclaimed = res.checkpoint.warm_pool is not None and res.checkpoint.claimed_at is None
            failure = self._enter_releasing(t, res, reason, layer, message) if first else None
            for d in self._sandbox_devices(t, sandbox_id):
                if d.state is S.ATTACHED:
                    t.transition(d, E.TEARDOWN, Actor.CUBELET, reason=reason)
                elif d.state in (S.RESERVED, S.PREPARING):
                    ev = E.ATTACH_FAILED if attach_failed else E.STARTUP_FAILED
                    t.transition(d, ev, Actor.CUBELET, reason=reason)
            stop = first and res.checkpoint.shim_started
        if failure is not None and not unclaimed:  # an unclaimed warm sandbox is the node's: nobody to tell
            error = status_error(failure)
            self.ended.record(sandbox_id, res.created_at, error)  # each heartbeat repeats it
            self.notify(sandbox_id, StatusBody(phase="failed", error=error))
        if stop:
            self.shim.stop(res.shim_id)
        self.try_release(sandbox_id)

    @staticmethod
    def _enter_releasing(t: Tx, res: Reservation, reason: str, layer: str, message: str) -> SandboxFailure | None:
        """The reservation's move to `releasing`, with the failure it records (None for a user's delete)."""
        was = res.phase.value
        res.fire(RE.TEARDOWN)
        res.releasing_since = t.now
        failure = None if reason == USER_RELEASE else SandboxFailure(reason, layer, message[:500] or reason, was)
        if failure is not None:
            res.checkpoint.failure = failure
        t.update_reservation(res)
        t.event(
            EventKind.TEARDOWN_STARTED,
            Actor.CUBELET,
            sandbox_id=res.sandbox_id,
            reason=reason,  # the teardown reason lives here, in the event trail
            details={"failure": None if failure is None else failure.to_json()},
        )
        return failure

    def vmm_status(self, res: Reservation) -> ShimStatus:
        if not res.checkpoint.shim_started:
            return ShimStatus(shim_alive=False, vmm_alive=False)
        return self.shim.status(res.shim_id)

    @staticmethod
    def vmm_gone(res: Reservation, st: ShimStatus) -> bool | None:
        """True only on host evidence that no VMM runs *and none can appear*: a live shim may still spawn
        one, so its own `vmm_exited` report is not enough — the shim process must be gone too, or have sent
        its final report (`shim_exiting`, sent after its teardown, after which it starts nothing)."""
        if not res.checkpoint.shim_started:
            return True
        if st.vmm_alive is None or st.shim_alive is None:
            return None
        shim_done = not st.shim_alive or res.checkpoint.shim_exited
        return not st.vmm_alive and shim_done

    def try_release(self, sandbox_id: str) -> None:
        """Apply the release rules to every `releasing` device of the sandbox.

        Past the release timeout the VMM is killed; only after `kill_grace_s` more are devices that still
        lack evidence quarantined. The reservation closes only once the VMM is proven gone, so a VMM that
        outlives its devices is never forgotten (nor its sandbox id reused while it runs).

        The devices are durably `releasing` (or `released`) here, so nothing else hands them out: the host
        work — VMM status, holder scans, reset, revalidation — runs under the sandbox's and then each device's
        own lock with no transaction open and without the lifecycle lock, and each outcome lands in one short
        compare-and-swap transaction. Other devices' reservations and every read go on meanwhile.
        """
        with self.device_locks.hold(f"sandbox:{sandbox_id}"):
            res = self.store.reservation(sandbox_id)
            if res is None:
                return
            now = float(self.store.clock())
            overdue = res.releasing_since is not None and now - res.releasing_since > self.config.release_timeout_s
            st, gone = self._vmm_evidence(res, now, overdue)
            give_up = overdue and (bool(gone) or self._kill_grace_over(res, now))
            for device_id in res.device_ids:
                self._release_device(device_id, res, st, give_up)
            # The sandbox's own host state (network namespace, scratch disk): host work, outside the lock too.
            host_events = self._release_sandbox_host(res) if gone else []
            if self._close_reservation(sandbox_id, st, gone, give_up, host_events):
                self.retire_runs()

    def _vmm_evidence(self, res: Reservation, now: float, overdue: bool) -> tuple[ShimStatus, bool | None]:
        """Rules 1 and 2: the VMM exited, and the shim is gone or sent its final report (`vmm_gone`).

        A shim that died mid-teardown will never stop its VMM: waiting for the timeout only holds the devices
        and the pinned memory. Its VMM is killed now, as is one past the release timeout; the rules still need
        proof it is gone, so the status is read again after the kill."""
        st = self.vmm_status(res)
        gone = self.vmm_gone(res, st)
        orphaned = st.shim_alive is False and st.vmm_alive is True
        if gone or not (overdue or orphaned) or res.checkpoint.kill_at is not None:
            return st, gone
        self._kill_vmm(res, now)
        st = self.vmm_status(res)
        return st, self.vmm_gone(res, st)

    def _kill_vmm(self, res: Reservation, now: float) -> None:
        """Once per reservation: the kill time is durable, so a restart waits out the same grace."""
        self.shim.kill(res.shim_id)
        res.checkpoint.kill_at = now
        with self.change() as t:
            cur = t.reservation(res.sandbox_id)
            if cur is not None and cur.checkpoint.kill_at is None:
                cur.checkpoint.kill_at = now
                t.update_reservation(cur)

    def _kill_grace_over(self, res: Reservation, now: float) -> bool:
        """A killed VMM gets `kill_grace_s` to be reaped before its devices' missing evidence is final."""
        kill_at = res.checkpoint.kill_at
        return kill_at is not None and now - kill_at > self.config.kill_grace_s

    def _release_device(self, device_id: str, res: Reservation, st: ShimStatus, give_up: bool) -> None:
        """Rules 3 and 4 for one device under its own lock: no holder, cleanup done (`_judge_release`); a
        `released` one is only revalidated (or scrubbed first)."""
        with self.device_locks.hold(device_id):
            d = self.store.device(device_id)
            if d is None or d.sandbox_id != res.sandbox_id:
                return
            if d.state is S.RELEASING:
                outcome = self._judge_release(d, res, st, give_up)
            elif d.state is S.RELEASED:
                outcome = ReleaseOutcome(revalidation=self.backend.validate(d))
            else:
                return
            self._apply_outcome(d, res.sandbox_id, outcome)
            self.advance_scrub(device_id)

    def _close_reservation(
        self, sandbox_id: str, st: ShimStatus, gone: bool | None, give_up: bool, host_events: list[HostEvent]
    ) -> bool:
        """The reservation closes only once the VMM is proven gone, no device is still the tenant's and the
        sandbox's network is torn down; True when it closed. Given up on with a VMM that will not go, it stays,
        marked once, so the VMM is never forgotten nor its sandbox id reused while it runs."""
        with self.change() as t:
            cur = t.reservation(sandbox_id)
            if cur is None:
                return False
            for e in host_events:
                t.event(e.kind, Actor.CUBELET, sandbox_id=sandbox_id, reason=e.reason, details=e.details)
            if any(e.kind == EventKind.NETWORK_TEARDOWN_FAILED for e in host_events):
                return False  # retried on the next pass: the reservation outlives its network until it is gone
            if any(d.state in TENANT_STATES for d in self._sandbox_devices(t, sandbox_id)):
                return False
            if gone:
                t.delete_reservation(sandbox_id)
                t.event(  # `facts` is the checkpoint's wire name; CubeMaster reads the failure from it
                    EventKind.RESERVATION_CLOSED,
                    Actor.CUBELET,
                    sandbox_id=sandbox_id,
                    details={"facts": cur.checkpoint.to_json()},
                )
                return True
            if give_up and not cur.checkpoint.vmm_survives:
                cur.checkpoint.vmm_survives = True
                t.event(
                    EventKind.RELEASE_VMM_SURVIVES,
                    Actor.CUBELET,
                    sandbox_id=sandbox_id,
                    reason="release.vmm_not_exited",
                    details={"vmm_pid": st.vmm_pid},
                )
                t.update_reservation(cur)
            return False

    def retire_runs(self) -> list[str]:
        """The files of runs that are over leave the live directory (kept for post-mortems by a bounded rule,
        cubelet/runfiles.py). Never fails a release: a run not retired now is retired at a later close."""
        try:
            return self.shim.retire_runs(lambda: {r.shim_id for r in self.store.reservations()})
        except OSError:
            return []

    def _release_sandbox_host(self, res: Reservation) -> list[HostEvent]:
        """Once the VMM is proven gone: remove the sandbox's network namespace (TAP, veth, rules) and its scratch
        disk. Idempotent (run on every pass until the reservation closes); returns the events to record, one
        `network_teardown_failed` while the namespace could not be removed."""
        from cubeaccel.host.net import netpolicy  # host I/O of the release path only

        sid = res.sandbox_id
        out: list[HostEvent] = []
        if removed := self.shim.release_files(res.shim_id):
            out.append(HostEvent(EventKind.SANDBOX_FILES_REMOVED, None, {"files": removed}))
        net = res.checkpoint.network
        if net is not None:
            try:
                found = netpolicy.teardown(sid, node=self.config.node_name, uplink_netns=net.get("uplink_netns"))
            except CubeError as e:
                return [
                    *out,
                    HostEvent(EventKind.NETWORK_TEARDOWN_FAILED, "network.teardown_failed", {"message": e.message}),
                ]
            if found:
                out.append(HostEvent(EventKind.NETWORK_REMOVED, None, {"netns": net.get("netns")}))
                self.audit_host("network:teardown", sid, netns=net.get("netns"))
        return out

    def audit_host(self, action: str, sandbox_id: str, **fields: Any) -> None:
        """Host changes made for a sandbox (not API requests) go into the Cubelet's audit trail too."""
        if self.audit is not None:
            self.audit.append(action, "cubelet", "ok", target=sandbox_id, node=self.config.node_name, **fields)

    def _judge_release(self, d: DeviceRecord, res: Reservation, st: ShimStatus, overdue: bool) -> ReleaseOutcome:
        """The release rules on host evidence, in their order (holders, node hand-back, reset, revalidation): host
        I/O, no transaction open. A rule not met holds the device (`waiting`), past the timeout for good."""
        gone = self.vmm_gone(res, st)
        if gone is None:
            return ReleaseOutcome(quarantine=Hold("release.vmm_state_unknown"))
        if (blocked := self._blocked(d, res, st, gone)) is not None:
            return ReleaseOutcome(quarantine=blocked) if overdue else ReleaseOutcome(waiting=blocked)
        if unreturned := self._reclaim_nodes(d):  # still openable by the last tenant's uid: never handed to the next
            return ReleaseOutcome(quarantine=Hold(unreturned[0].code, problems=tuple(unreturned)))
        # unclean: the VMM was killed, or a started shim never sent its final report (it or its VMM died)
        unclean = res.checkpoint.kill_at is not None or (res.checkpoint.shim_started and not res.checkpoint.shim_exited)
        problems, ladder = self.reset_device(d, unclean)
        if problems:
            return ReleaseOutcome(cleanup=problems)
        return ReleaseOutcome(evidence=self._evidence(d, res, st, ladder), revalidation=self.backend.validate(d))

    def _blocked(self, d: DeviceRecord, res: Reservation, st: ShimStatus, gone: bool) -> Hold | None:
        """The VMM exited (and no shim can start another), and nothing holds the device's files: an fd that
        cannot be read is an unknown holder. A confirmed detach is recorded, never a substitute."""
        holders = self.backend.holders(d) if gone else []
        if not gone:
            reason = "release.vmm_not_exited"
        elif any(h.unknown for h in holders):
            reason = "release.holder_unknown"
        elif holders:
            reason = "release.holder_stuck"
        else:
            return None
        return Hold(reason, Blocking(tuple(holders), st.vmm_pid, st.shim_alive, d.id in res.checkpoint.detached))

    def _evidence(
        self, d: DeviceRecord, res: Reservation, st: ShimStatus, ladder: list[ResetAttempt] | None
    ) -> ReleaseEvidence:
        policy = self.scrub_policy(d)
        started = res.checkpoint.shim_started
        return ReleaseEvidence(
            shim_exited=not st.shim_alive,
            shim_final_report=res.checkpoint.shim_exited,
            detach_confirmed=d.id in res.checkpoint.detached,
            reset_ladder=None if ladder is None else tuple(ladder),
            scrub_owed=policy is ScrubPolicy.TRUSTED_VM and scrub_needs_vm(d) and started,
            scrub_policy=policy,
            scrub_method=scrub_method_name(d),
            vmm_started=started,
        )

    def reset_device(self, d: DeviceRecord, unclean: bool) -> tuple[list[Problem], list[ResetAttempt] | None]:
        """Release step: the backend's reset — through its reset ladder where it has one, told which other devices
        a tenant holds (a bus reset must never reach them) and whether the VMM ended cleanly."""
        ladder = self.capabilities.ladder
        if ladder is None:
            return self.backend.cleanup(d), None
        reserved = {
            o.address: f"{o.state.value} (sandbox {o.sandbox_id})"
            for o in self.store.devices()
            if o.id != d.id and o.state in TENANT_STATES
        }
        result = ladder.reset_ladder(d, ResetContext(unclean_exit=unclean, reserved=reserved))
        return result.problems, result.attempts

    def _reclaim_nodes(self, d: DeviceRecord) -> list[Problem]:
        """Release step: device nodes handed to the VMM's uid go back to root (VFIO group nodes)."""
        nodes = self.capabilities.nodes
        return nodes.reclaim_nodes(d) if nodes is not None else []

    def _apply_outcome(self, d: DeviceRecord, sandbox_id: str, o: ReleaseOutcome) -> None:
        """One short transaction, a compare-and-swap on the record the host work started from: a device that
        changed meanwhile (an operator, reconcile) keeps what they decided."""
        with self.change() as t:
            cur = t.device(d.id)
            if cur is None or (cur.state, cur.generation) != (d.state, d.generation):
                return
            if o.quarantine is not None:
                hold = o.quarantine
                t.transition(cur, E.QUARANTINE, Actor.CUBELET, reason=hold.reason, details=hold.details())
            elif o.waiting is not None:
                self._record_waiting(t, d, sandbox_id, o.waiting)
            elif o.cleanup:
                record_problems(t, cur, o.cleanup)
            else:
                if o.evidence is not None:
                    pending = SCRUB_PENDING if o.evidence.scrub_owed else None
                    details = o.evidence.to_json()
                    cur = t.transition(cur, E.RELEASE_CONFIRMED, Actor.CUBELET, reason=pending, details=details)
                if self.scrub_owed(cur):
                    return  # revalidation waits for the scrub, started right after this transaction
                self._finish_revalidation(t, cur, o.revalidation or [])

    @staticmethod
    def _record_waiting(t: Tx, d: DeviceRecord, sandbox_id: str, hold: Hold) -> None:
        """One `release_waiting` event per device and cause, the cause kept in the reservation."""
        res = t.reservation(sandbox_id)
        if res is None:
            return
        waiting = res.checkpoint.release_waits
        if hold.reason in waiting.get(d.id, []):
            return
        waiting.setdefault(d.id, []).append(hold.reason)
        t.update_reservation(res)
        t.event(
            EventKind.RELEASE_WAITING,
            Actor.CUBELET,
            device_id=d.id,
            sandbox_id=sandbox_id,
            reason=hold.reason,
            details=hold.details(),
        )

    # ---- scrub between tenants (cubelet/scrub.py, docs/scrub.md) ----------------------------------------------------
    def scrub_policy(self, d: DeviceRecord) -> ScrubPolicy:
        return policy_for(self.config.scrub_policy, d)

    def scrub_refusal(self, d: DeviceRecord) -> Problem | None:
        """Held under trusted-vm: `host.no_scrub_method` for a kind with no registered scrub method, and
        `host.scrub_image_missing` / `host.scrub_image_mismatch` while the image its scrub VM boots is not here
        (as the last readiness check found it): the device could not be cleared after a tenant."""
        refused = refusal(self.config.scrub_policy, d)
        if refused is not None or self.scrub_policy(d) is not ScrubPolicy.TRUSTED_VM:
            return refused
        method = method_for(d.identity)
        if method is None or not method.needs_vm:
            return None
        return self.scrub_image_problems.get(method.image_stack)

    @staticmethod
    def scrub_owed(d: DeviceRecord) -> bool:
        """Persisted in the record (its reason while `released`), so a restart mid-scrub scrubs again."""
        return d.state is S.RELEASED and d.reason == SCRUB_PENDING

    def advance_scrub(self, device_id: str) -> bool:
        """Start, or finish, the scrub a `released` device owes. True when the device is the scrub's (nothing else
        may revalidate it now). Called under the device's lock."""
        d = self.store.device(device_id)
        if d is None or not self.scrub_owed(d):
            return False
        job = self.scrubs.get(d.id)
        if job is not None and job.generation == d.generation:
            if job.outcome is not None:
                self._finish_scrub(d, job)
            return True
        job = self.scrubs[d.id] = ScrubJob(d.generation, time.monotonic())
        policy = self.scrub_policy(d)
        with self.change() as t:
            t.event(
                EventKind.SCRUB_STARTED,
                Actor.CUBELET,
                device_id=d.id,
                sandbox_id=d.sandbox_id,  # the tenant whose leftovers are being cleared
                details={"policy": policy.value, "timeout_s": self.config.scrub_timeout_s},
            )
        if self.scrub_runner.inline:
            job.outcome = self._run_scrub(d)
            self._finish_scrub(d, job)
        else:
            threading.Thread(target=self._scrub_thread, args=(d, job), name=f"scrub-{d.id}", daemon=True).start()
        return True

    def _run_scrub(self, d: DeviceRecord) -> ScrubOutcome:
        try:
            return self.scrub_runner.run(d, self.backend.attach_spec(d), self.config.scrub_timeout_s)
        except Exception as e:  # a runner bug is a scrub that did not happen
            return ScrubOutcome(False, f"scrub runner: {type(e).__name__}: {e}"[:500])

    def _scrub_thread(self, d: DeviceRecord, job: ScrubJob) -> None:
        job.outcome = self._run_scrub(d)  # the VM runs without the device lock: reads of the device go on
        try:
            with self.device_locks.hold(d.id):
                self.advance_scrub(d.id)
        except Exception:  # e.g. the store closed under a stopping Cubelet: the outcome stays, reconcile applies it
            return

    def _finish_scrub(self, d: DeviceRecord, job: ScrubJob) -> None:
        """Passed: reset again (the scrub VM was the device's last user) and revalidate. Failed: quarantine."""
        o = job.outcome
        assert o is not None
        unreturned, problems = self._after_scrub_vm(d) if o.ok else ([], [])
        duration = round(time.monotonic() - job.started, 3)
        reset_after = None if not o.ok else (problems[0].code if problems else "ok")  # the reset after the scrub VM
        with self.change() as t:
            if self.scrubs.get(d.id) is job:
                del self.scrubs[d.id]
            cur = t.device(d.id)
            if cur is None or (cur.state, cur.generation) != (d.state, d.generation):
                return  # an operator or reconcile decided meanwhile
            details = {"ok": o.ok, "duration_s": duration, "message": o.message, **o.details}
            details["reset_after"] = reset_after
            t.event(EventKind.SCRUB_FINISHED, Actor.CUBELET, device_id=d.id, sandbox_id=d.sandbox_id, details=details)
            if not o.ok:
                t.transition(cur, E.QUARANTINE, Actor.CUBELET, reason=o.reason, details=details)
            elif unreturned:  # still openable by the scrub VM's uid: never handed to the next tenant
                hold = Hold(unreturned[0].code, problems=tuple(unreturned))
                t.transition(cur, E.QUARANTINE, Actor.CUBELET, reason=hold.reason, details=hold.details())
            else:
                self._finish_revalidation(t, cur, problems)

    def _after_scrub_vm(self, d: DeviceRecord) -> tuple[list[Problem], list[Problem]]:
        """(nodes not taken back, what the reset and revalidation found). The scrub VM was a VMM like a tenant's:
        what the release path takes back from one (the VFIO group node handed to its uid) is taken back here too,
        before this reset."""
        unreturned = self._reclaim_nodes(d)
        return unreturned, unreturned or self.reset_device(d, unclean=False)[0] or self.backend.validate(d)

    def _finish_revalidation(self, t: Tx, d: DeviceRecord, problems: list[Problem]) -> None:
        from cubeaccel.cubelet import host_ready  # it builds on the lifecycle; imported late

        if problems and all(p.held for p in problems):  # sound and cleaned, but not served here: as not ready
            d = t.transition(d, E.REVALIDATED, Actor.CUBELET, sandbox_id=None)
            record_problems(t, d, problems)
            return
        if problems:
            record_problems(t, d, problems)
            return
        d = t.transition(d, E.REVALIDATED, Actor.CUBELET, sandbox_id=None)
        readiness = host_ready.current(t)
        if not readiness.ready:  # a host that stopped being ready gets nothing back, not even for one tick
            t.transition(d, E.HOST_NOT_READY, Actor.CUBELET, reason=readiness.problems[0].code)

    def expire_reservations(self) -> list[str]:
        now = float(self.store.clock())
        expired = [
            r.sandbox_id
            for r in self.store.reservations()
            if r.phase is P.RESERVED and r.expires_at is not None and r.expires_at < now
        ]
        for sid in expired:
            with self.store.tx() as t:
                t.event(EventKind.RESERVATION_EXPIRED, Actor.CUBELET, sandbox_id=sid, reason="reserve.expired")
            self.begin_teardown(sid, "reserve.expired", message="the reservation was never started")
        for r in self.store.reservations():  # every sandbox has a lifetime, also one created here directly
            started = r.checkpoint.started_at
            lifetime = float(r.params.lifetime_s or self.config.default_lifetime_s)
            if r.phase in (P.STARTING, P.RUNNING) and started is not None and now - started > lifetime:
                with self.store.tx() as t:
                    t.event(
                        EventKind.LIFETIME_EXPIRED,
                        Actor.CUBELET,
                        sandbox_id=r.sandbox_id,
                        reason="sandbox.lifetime_expired",
                    )
                self.begin_teardown(r.sandbox_id, "sandbox.lifetime_expired", message=f"lived past {lifetime:g}s")
                expired.append(r.sandbox_id)
        return expired
