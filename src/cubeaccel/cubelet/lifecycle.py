"""Reserve → prepare → attach → release → revalidate, driven by Cubelet and by shim reports.

Cubelet alone moves devices in and out of `allocatable`. Shim reports are evidence; the release
rules (VMM exited, shim exited or final report, no holders, reset done, revalidated) decide.
"""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
import secrets
import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from cubeaccel.backends.base import Backend, Capabilities, Problem
from cubeaccel.cubelet import host_ready, memory_ledger
from cubeaccel.cubelet.capacity_wait import CapacityWaits, reserve_waiting
from cubeaccel.cubelet.ended import EndedSandboxes
from cubeaccel.cubelet.journal import Journal
from cubeaccel.cubelet.locks import KeyedLocks
from cubeaccel.cubelet.placement import choose_devices, matches
from cubeaccel.cubelet.release import CubeletConfig, ReleasePath, problem_event, record_problems, sandbox_devices
from cubeaccel.cubelet.sandbox_ids import token_digest, validate_sandbox_id
from cubeaccel.cubelet.scrub import ScrubPolicy, ScrubRunner
from cubeaccel.cubelet.shim_driver import ShimDriver, ShimStatus
from cubeaccel.cubelet.store import Reservation, Tx
from cubeaccel.cubelet.warm import WarmPools
from cubeaccel.host.net import netpolicy
from cubeaccel.host.service.audit import AuditLog
from cubeaccel.host.vmm import confine
from cubeaccel.host.vmm.meminfo import available_mib
from cubeaccel.model.checkpoint import ReservationCheckpoint
from cubeaccel.model.contract import (
    CompatibilityContract,
    ContractViolation,
    Layer,
    check_device,
    check_guest,
    check_template,
)
from cubeaccel.model.device import DeviceRecord
from cubeaccel.model.event_kinds import EventKind
from cubeaccel.model.guest_minimal import check_minimal
from cubeaccel.model.reservation_params import CarriedContract, NetworkRequest, ReservationParams, parse_contract
from cubeaccel.model.reservation_states import STARTED_PHASES, ReservationEvent, ReservationPhase
from cubeaccel.model.reset_ladder import ResetAttempt
from cubeaccel.model.sandbox_policy import (
    FilesystemPolicy,
    NetworkPolicy,
    SandboxPolicy,
    forbidden_overlap,
    mount_not_allowlisted,
    narrowed,
)
from cubeaccel.model.snapshot_layouts import template_bars
from cubeaccel.model.states import Actor, DeviceEvent, DeviceState
from cubeaccel.protocol.errors import CubeError, conflict, invalid, not_found
from cubeaccel.protocol.reports import GuestReport, ShimReport, ShimReportKind
from cubeaccel.transport.telemetry import request_id
from cubeaccel.wire.master_api import StatusBody, WorkloadCondition
from cubeaccel.wire.reports import (
    DeviceAttached,
    GuestValidated,
    StartFailed,
    VmmConfined,
    VmStarted,
    WorkloadRecovered,
    WorkloadUnresponsive,
)
from cubeaccel.wire.shim_spec import DeviceSpec, MemoryFile, MountSpec, NetSpec, ShimSpec
from cubeaccel.wire.warm import WarmPoolBody, WarmPoolSetting

S, E = DeviceState, DeviceEvent
P, RE = ReservationPhase, ReservationEvent
MAX_COUNT = 64
__all__ = ["Cubelet", "CubeletConfig", "ReservationRequest", "problem_event", "record_problems", "validate_sandbox_id"]


@dataclass(frozen=True)
class ReservationRequest:
    count: int = 1
    accel_class: str | None = None
    labels: tuple[tuple[str, str], ...] = ()
    template: str | None = None
    memory_mib: int = 512
    vcpus: int = 1
    pin_memory: bool = True
    contract: CompatibilityContract | None = None  # parsed where it arrived; re-checked by `request_params`
    lifetime_s: float | None = None  # from start; None: the Cubelet's default_lifetime_s (no sandbox lives forever)
    network: NetworkRequest | None = None  # the request's narrowing of the template's network policy
    tenant: str | None = None  # whose sandbox (CubeMaster says); audited with the assignment


def recheck_contract(contract: CompatibilityContract) -> CarriedContract:
    """A frozen contract from another process, re-checked, not trusted: an inconsistent one is refused up front."""
    carried = parse_contract(contract)
    broken = check_template(carried.template)
    if broken:
        v = broken[0]
        raise CubeError(
            v.code,
            f"frozen contract is not consistent ({v.layer.value}): expected {v.expected}, found {v.found}",
            v.layer.value,
            {"violations": [x.to_json() for x in broken]},
            422,
        )
    return carried


def contract_refusal(violations: list[ContractViolation], count: int) -> CubeError:
    v = violations[0]
    return CubeError(
        code=v.code,
        message=f"no allocatable device satisfies the contract ({v.layer.value}): expected {v.expected}, "
        f"found {v.found}",
        layer=v.layer.value,
        details={"requested": count, "violations": [x.to_json() for x in violations]},
        status=409,
    )


class Cubelet:
    """The node agent's lifecycle: reserve, start, shim reports; the release path is its own object (`release_path`).

    Built whole by the composition root (`cubelet/runtime.py::assemble`), which hands it the journal, backend,
    shim driver and release path it shares with the parts it builds; the warm pools, which drive this facade,
    are built here, last, from it."""

    def __init__(
        self,
        journal: Journal,
        backend: Backend,
        capabilities: Capabilities,
        shim: ShimDriver,
        config: CubeletConfig,
        release_path: ReleasePath,
        *,
        device_locks: KeyedLocks,
        ended: EndedSandboxes,
    ) -> None:
        self.journal = journal
        self.store = journal.store
        self.lock = journal.lock
        self.backend = backend
        self.capabilities = capabilities  # checked once; call sites never probe the backend
        self.shim = shim
        self.config = config
        self.release_path = release_path
        self.vmm_host = self.config.vmm_host or memory_ledger.VmmHost.here(vfio=backend.name == "vfio")
        self.device_locks = device_locks  # host work per device (and per sandbox while it is released)
        self.launching: set[str] = set()  # sandboxes whose shim this process is launching right now
        self.incarnation = uuid.uuid4().hex  # this process's: CubeMaster reconciles a node whose incarnation changed
        self.ended = ended  # what this process ended on its own, repeated by its heartbeats
        self.issued_tokens: dict[str, str] = {}  # sandbox → workload token not yet given to the caller
        self.loaded_networks: dict[str, netpolicy.Loaded] = {}  # sandbox → its namespace's last loaded ruleset
        self.capacity_waits = CapacityWaits()  # reserves waiting for devices coming back, oldest first
        journal.store.listeners.append(self.capacity_waits.on_events)
        self.warm = WarmPools(self, self.config.warm_max_concurrent_starts)  # docs/warm.md
        self.warm.restore()  # the pools and drain this node was given, before reconcile looks at warm sandboxes
        shim.bind(self.handle_report)

    # ---- the release path's verbs, for the parts that drive it (reconcile, operator, warm, inventory) -----------
    def change(self) -> AbstractContextManager[Tx]:
        """One lifecycle decision: under the lifecycle lock, in one transaction, durable on return."""
        return self.journal.change()

    @staticmethod
    def _sandbox_devices(t: Tx, sandbox_id: str) -> list[DeviceRecord]:
        return sandbox_devices(t, sandbox_id)

    @property
    def audit(self) -> AuditLog | None:
        return self.release_path.audit

    @property
    def scrub_runner(self) -> ScrubRunner:
        return self.release_path.scrub_runner

    @property
    def scrub_image_problems(self) -> dict[str, Problem]:
        return self.release_path.scrub_image_problems

    def set_scrub_image_problems(self, problems: dict[str, Problem]) -> None:
        self.release_path.set_scrub_image_problems(problems)

    def notify(self, sandbox_id: str, status: StatusBody) -> None:
        self.release_path.notify(sandbox_id, status)

    def audit_host(self, action: str, sandbox_id: str, **fields: Any) -> None:
        self.release_path.audit_host(action, sandbox_id, **fields)

    def begin_teardown(
        self, sandbox_id: str, reason: str, attach_failed: bool = False, layer: str = "cubelet", message: str = ""
    ) -> None:
        self.release_path.begin_teardown(sandbox_id, reason, attach_failed, layer, message)

    def try_release(self, sandbox_id: str) -> None:
        self.release_path.try_release(sandbox_id)

    def expire_reservations(self) -> list[str]:
        return self.release_path.expire_reservations()

    def retire_runs(self) -> list[str]:
        return self.release_path.retire_runs()

    def vmm_status(self, res: Reservation) -> ShimStatus:
        return self.release_path.vmm_status(res)

    vmm_gone = staticmethod(ReleasePath.vmm_gone)

    def reset_device(self, d: DeviceRecord, unclean: bool) -> tuple[list[Problem], list[ResetAttempt] | None]:
        return self.release_path.reset_device(d, unclean)

    def scrub_policy(self, d: DeviceRecord) -> ScrubPolicy:
        return self.release_path.scrub_policy(d)

    def scrub_refusal(self, d: DeviceRecord) -> Problem | None:
        return self.release_path.scrub_refusal(d)

    def advance_scrub(self, device_id: str) -> bool:
        return self.release_path.advance_scrub(device_id)

    # ---- helpers --------------------------------------------------------------------------------
    def pinnable_mib(self) -> int:
        """Guest memory this node could allocate and lock now (the contract's pinned_memory layer)."""
        configured = self.config.pinnable_memory_mib
        return available_mib() if configured is None else configured

    @property
    def max_devices_per_sandbox(self) -> int:
        """What one reservation may take here: the heartbeat advertises it, so CubeMaster filters on the same
        number `reserve` enforces."""
        return min(MAX_COUNT, self.shim.max_devices)

    # ---- reserve and start ----------------------------------------------------------------------
    def reserve(
        self, sandbox_id: str, req: ReservationRequest, capacity_wait_s: float = 0.0, yield_to_waiting: bool = False
    ) -> Reservation:
        """Reserve `req`'s devices for `sandbox_id`, or refuse. `capacity_wait_s`: when the devices that would fit
        are coming back (releasing, being scrubbed), wait for them that long, in arrival order
        (cubelet/capacity_wait.py). `yield_to_waiting` (the warm refill): refused while a waiting reserve is
        owed a device this one could take."""
        if capacity_wait_s <= 0:
            return self._reserve_now(sandbox_id, req, yield_to_waiting)
        validate_sandbox_id(sandbox_id)
        with self.capacity_waits.queued(sandbox_id, req.accel_class) as w:
            res = reserve_waiting(
                self.capacity_waits,
                w,
                lambda: self._reserve_now(sandbox_id, req),
                lambda: self.returning_fit(req),
                capacity_wait_s,
            )
        assert isinstance(res, Reservation)
        return res

    def returning_fit(self, req: ReservationRequest) -> int:
        """Matching devices releasing or being scrubbed, when they and the free ones would hold `req`; else 0."""
        back = (S.RELEASING, S.RELEASED)
        with self.store.read() as t:
            devices = t.devices()
        coming = [d for d in devices if d.state in back and matches(d, req.accel_class, dict(req.labels))]
        soon = [dataclasses.replace(d, state=S.ALLOCATABLE) if d.state in back else d for d in devices]
        fits = coming and choose_devices(soon, req.count, req.accel_class, dict(req.labels)) is not None
        return len(coming) if fits else 0

    def _reserve_now(self, sandbox_id: str, req: ReservationRequest, yield_to_waiting: bool = False) -> Reservation:
        validate_sandbox_id(sandbox_id)
        contract, params = self.request_params(req)
        self._check_count(req.count, contract)
        with self.change() as t:
            if yield_to_waiting and (owed := self.capacity_waits.owed(req.accel_class)):
                raise conflict(
                    "reserve.insufficient_devices",
                    f"{len(owed)} reserve(s) are waiting for devices here; they go first",
                    details={"requested": req.count, "owed_to": owed},
                )
            existing = t.reservation(sandbox_id)
            if existing is not None:
                if existing.phase is P.RELEASING:
                    raise conflict("sandbox.releasing", f"sandbox {sandbox_id} is still being released")
                if existing.params.to_json() == params.to_json():  # as recorded: a contract by its JSON
                    return existing
                raise conflict(
                    "reserve.sandbox_conflict",
                    f"sandbox {sandbox_id} already holds devices with different parameters",
                    details={"existing": existing.params.as_stored()},
                )
            host_ready.refuse_if_not_ready(t)
            devices = [] if req.count == 0 else t.devices(S.ALLOCATABLE)  # the others are counted on refusal
            eligible, refused = devices, []
            if contract is not None and devices:  # stage 3 of the contract: the physical device itself
                pinnable = self.pinnable_mib()
                verdicts = {d.id: check_device(contract, d, pinnable_memory_mib=pinnable) for d in devices}
                eligible = [d for d in devices if not verdicts[d.id]]
                refused = [v for vs in verdicts.values() for v in vs]
            chosen = choose_devices(eligible, req.count, req.accel_class, dict(req.labels))
            if chosen is None and refused:
                raise contract_refusal(refused, req.count)
            if chosen is None:
                by_state: dict[str, int] = {}
                for d in t.devices():
                    by_state[d.state.value] = by_state.get(d.state.value, 0) + 1
                raise conflict(
                    "reserve.insufficient_devices",
                    f"{req.count} device(s) requested, not enough allocatable matching devices",
                    details={"requested": req.count, "devices_by_state": by_state},
                )
            memory_ledger.admit(
                t, sandbox_id, params, self.config.pinnable_memory_mib, self.vmm_host
            )  # no device moved
            for d in chosen:
                t.transition(
                    d,
                    E.RESERVE,
                    Actor.CUBELET,
                    sandbox_id=sandbox_id,
                    details={
                        "template": req.template,
                        "memory_mib": req.memory_mib,
                        "tenant": req.tenant,
                        "contract_digest": contract.digest if contract is not None else None,
                    },
                )
            res = Reservation(
                sandbox_id, params, [d.id for d in chosen], P.RESERVED, t.now, t.now + self.config.reservation_ttl_s
            )
            t.insert_reservation(res)
            t.event(
                EventKind.RESERVATION_CREATED,
                Actor.CUBELET,
                sandbox_id=sandbox_id,
                details={"device_ids": res.device_ids, "params": params.to_json()},
            )
            return res

    def _check_count(self, count: int, contract: CompatibilityContract | None) -> None:
        """A CPU-only contract takes exactly no device; any other reservation 1..the node's per-VM limit."""
        if contract is not None and contract.template.cpu_only:
            if count != 0:
                raise invalid(
                    "reserve.invalid_count",
                    f"template {contract.template_name} is CPU-only: count must be 0, got {count}",
                )
            return
        limit = self.max_devices_per_sandbox
        if not 1 <= count <= limit:
            raise invalid(
                "reserve.invalid_count",
                f"count must be 1..{limit} on this node (one VM takes at most "
                f"{self.shim.max_devices} devices), got {count}",
            )

    @staticmethod
    def pool_request(shape: WarmPoolBody | WarmPoolSetting) -> ReservationRequest:
        """A warm pool's shape as a reservation request (no tenant, lifetime or labels: those come with a claim)."""
        return ReservationRequest(
            count=shape.count,
            accel_class=shape.accel_class,
            template=shape.template,
            memory_mib=shape.memory_mib,
            vcpus=shape.vcpus,
            pin_memory=shape.pin_memory,
            contract=None if shape.contract is None else parse_contract(shape.contract),  # a journal's: a dict
        )

    def request_params(self, req: ReservationRequest) -> tuple[CarriedContract | None, ReservationParams]:
        """The reservation's recorded parameters: the frozen contract's memory and the effective network policy
        (what the sandbox gets), re-derived here. A warm pool's key is derived from these too."""
        contract = None if req.contract is None else recheck_contract(req.contract)
        network = self.network_policy(contract, req.network)
        params = ReservationParams(
            count=req.count,
            accel_class=req.accel_class,
            labels=dict(req.labels),
            template=req.template,
            memory_mib=req.memory_mib if contract is None else contract.memory_mib,
            vcpus=req.vcpus,
            pin_memory=req.pin_memory if contract is None else contract.pin_memory,
            contract=contract,
            lifetime_s=req.lifetime_s,
            network=network if network.has_nic else None,  # the effective policy: what the sandbox gets, recorded
            tenant=req.tenant,
        )
        return contract, params

    def network_policy(self, contract: CompatibilityContract | None, requested: NetworkRequest | None) -> NetworkPolicy:
        """The sandbox's policy, re-derived here (not trusted from CubeMaster): the template's narrowed by the
        request; refused when it names this node's pool, needs a NIC this node cannot build, or a mount the
        operator did not allowlist."""
        tpl = contract.template.sandbox if contract is not None else SandboxPolicy()
        if requested is not None and contract is None:
            raise invalid("network.policy_widened", "a network policy needs a template that declares one")
        policy = tpl.network if requested is None else narrowed(tpl.network, requested.asked)
        pool = ipaddress.IPv4Network(self.config.network_pool)
        if bad := forbidden_overlap(policy, [pool]):
            raise conflict(
                "network.pool_overlap",
                f"egress {', '.join(bad)} reaches this node's sandbox pool {pool} (other sandboxes)",
                layer="cubelet",
                details={"rules": bad, "pool": str(pool)},
            )
        if policy.has_nic and self.shim.host_devices and (why := netpolicy.available()) is not None:
            raise conflict("network.unavailable", f"this node cannot build sandbox networks: {why}", layer="cubelet")
        if outside := mount_not_allowlisted(tpl.filesystem, self.config.readonly_mount_allowlist):
            raise conflict(
                "filesystem.mount_not_allowlisted",
                f"read-only mount source(s) {', '.join(outside)} not allowlisted on node {self.config.node_name}",
                layer="cubelet",
                details={"sources": outside, "allowlist": list(self.config.readonly_mount_allowlist)},
            )
        return policy

    def _build_network(self, sandbox_id: str) -> None:
        """The sandbox's namespace, TAP and rules, before its shim starts; recorded (and audited) before use,
        so the release path removes it whatever happens next."""
        res = self.store.reservation(sandbox_id)
        if res is None or not self.shim.host_devices:
            return
        policy = res.params.network
        if policy is None or not policy.has_nic:
            return
        net = netpolicy.setup(
            sandbox_id,
            policy,
            node=self.config.node_name,
            pool=self.config.network_pool,
            uplink_netns=self.config.network_uplink_netns,
        )
        with self.change() as t:
            cur = self._reservation(t, sandbox_id)
            cur.checkpoint.network = net.to_json()
            t.update_reservation(cur)
            t.event(EventKind.NETWORK_APPLIED, Actor.CUBELET, sandbox_id=sandbox_id, details=net.to_json())
        self.release_path.audit_host(
            "network:apply", sandbox_id, netns=net.netns, egress=list(net.egress), veth=net.veth_cidr
        )

    def start(self, sandbox_id: str, token: str | None = None, warm_pool: str | None = None) -> Reservation | None:
        """Revalidate, move devices to `preparing`, record the intent, then launch the shim.

        Revalidation is host I/O and runs before the transaction; the transaction then moves exactly the
        records that were validated (a compare-and-swap on their generation)."""
        with self.store.read() as t:
            res = self._reservation(t, sandbox_id)
            devs = self._sandbox_devices(t, sandbox_id)
        if res.phase is not P.RESERVED:
            if res.phase in STARTED_PHASES:
                return res
            raise conflict("sandbox.releasing", f"sandbox {sandbox_id} is being released")
        failed = {d.id: self.backend.validate(d) for d in devs}
        with self.lock:
            self.launching.add(sandbox_id)  # before the intent is durable: reconcile must not judge a launch
        try:
            return self._start(sandbox_id, devs, failed, token, warm_pool)
        finally:
            with self.lock:
                self.launching.discard(sandbox_id)

    def _start(
        self,
        sandbox_id: str,
        devs: list[DeviceRecord],
        failed: dict[str, list[Problem]],
        given: str | None = None,
        warm_pool: str | None = None,
    ) -> Reservation | None:
        with self.change() as t:
            res = self._reservation(t, sandbox_id)
            if res.phase is not P.RESERVED:
                if res.phase in STARTED_PHASES:
                    return res
                raise conflict("sandbox.releasing", f"sandbox {sandbox_id} is being released")
            if any(failed.values()):
                t.event(
                    EventKind.STARTUP_FAILED,
                    Actor.CUBELET,
                    sandbox_id=sandbox_id,
                    reason="prepare.revalidation_failed",
                    details={k: [p.__dict__ for p in v] for k, v in failed.items() if v},
                )
                start_ok = False
            else:
                for d in devs:
                    t.transition(d, E.PREPARE, Actor.CUBELET)
                res.fire(RE.START)
                res.expires_at = None
                cp = res.checkpoint
                cp.shim_started = True  # intent recorded before the act
                cp.started_at = t.now
                cp.start_id = uuid.uuid4().hex[:16]
                cp.image_digest = self._image_digest(res)  # what the shim boots, by digest
                # This start's workload token (only its hash is kept): ours, or the one the caller derived
                # (the E2B front door derives it from the sandbox id to hand it out again on connect).
                # A warm start has none: its shim binds an unknowable one until a claim brings the tenant's.
                token = None if warm_pool else given or secrets.token_urlsafe(32)
                cp.workload_token_sha256 = None if token is None else token_digest(token)
                cp.warm_pool = warm_pool
                t.update_reservation(res)
                start_ok = True
        if not start_ok:
            self.release_path.begin_teardown(sandbox_id, "prepare.revalidation_failed", layer="host_hardware")
            raise conflict(
                "prepare.revalidation_failed", f"devices of {sandbox_id} failed revalidation", layer="host_hardware"
            )
        try:
            self._build_network(sandbox_id)  # host work: outside the lifecycle lock
            spec = self._spec(sandbox_id).model_copy(
                update={
                    "workload": True,
                    "warm": token is None,
                    "workload_token": None if token is None else SecretStr(token),
                    "request_id": request_id(),
                }
            )
            if token is not None:
                self.issued_tokens[sandbox_id] = token  # handed to the caller by the API reply, once (take_token)
            self.shim.start(spec)
        except (CubeError, OSError) as e:  # the shim could not even be launched
            code = e.code if isinstance(e, CubeError) else "shim.launch_failed"
            self.handle_report(
                ShimReport(
                    sandbox_id,
                    ShimReportKind.ATTACH_FAILED,
                    (),
                    {"reason": code, "message": str(e)[:500]},
                    time.time(),
                    res.checkpoint.start_id,
                )
            )
        return self.store.reservation(sandbox_id)  # None when startup failed and released already

    def take_token(self, sandbox_id: str) -> str | None:
        """The workload token issued by this process's last start of the sandbox, once: a second call, a later
        read or a restarted Cubelet gets None (the caller that started it got it)."""
        with self.lock:
            return self.issued_tokens.pop(sandbox_id, None)

    def workload_token_ok(self, sandbox_id: str, token: str) -> bool:
        """Whether `token` is the one issued for the sandbox's current start (compared by hash, constant time)."""
        res = self.store.reservation(sandbox_id)
        want = None if res is None else res.checkpoint.workload_token_sha256
        return want is not None and hmac.compare_digest(token_digest(token), want)

    def _spec(self, sandbox_id: str) -> ShimSpec:
        with self.store.read() as t:
            res = self._reservation(t, sandbox_id)
            devs = self._sandbox_devices(t, sandbox_id)
            node_devs = t.devices()
        shim_devs = []
        for d in devs:
            a = self.backend.attach_spec(d)
            shim_devs.append(
                DeviceSpec(
                    device_id=d.id,
                    address=str(d.address),
                    driver=a.driver,
                    properties=a.properties,
                    vendor_id=d.identity.vendor_id,
                    device_id_hex=d.identity.device_id,
                    bars=d.identity.bars,
                    numa_node=d.numa_node,
                    memory_file=None
                    if a.memory_file is None
                    else MemoryFile(path=Path(a.memory_file[0]), size=a.memory_file[1]),
                )
            )
        p = res.params
        contract = p.contract
        fs = contract.template.sandbox.filesystem if contract is not None else FilesystemPolicy()
        net = res.checkpoint.network
        return ShimSpec(
            network=None
            if net is None
            else NetSpec(
                netns=netpolicy.NETNS_DIR / net["netns"],
                tap=net["tap"],
                guest_cidr=net["guest_cidr"],
                gateway=net["gateway"],
                mac=net["mac"],
            ),
            scratch_mib=fs.scratch_mib,
            readonly_mounts=tuple(MountSpec(source=Path(m.source), target=m.target) for m in fs.readonly_mounts),
            sandbox_id=sandbox_id,
            devices=tuple(shim_devs),
            memory_mib=p.memory_mib,
            vcpus=p.vcpus,
            pin_memory=p.pin_memory,
            contract=contract,
            start_id=res.checkpoint.start_id,
            image_digest=res.checkpoint.image_digest or self._image_digest(res),
            hotplug=contract.hotplug if contract is not None else True,
            template_bars=template_bars(contract, node_devs, devs),  # as the node's snapshots were prepared
        )

    def _image_digest(self, res: Reservation) -> str | None:
        """The contract's pinned guest image; without a contract, the node's default (its newest intact image).

        The shim is always told a digest and never picks one itself; None (no image on the node) makes it refuse.
        """
        contract = res.params.contract
        if contract is not None:
            return contract.template.guest_image_digest
        return self.shim.node_facts().default_image

    def _reservation(self, t: Tx, sandbox_id: str) -> Reservation:
        res = t.reservation(sandbox_id)
        if res is None:
            raise not_found("reservation.not_found", f"no reservation for sandbox {sandbox_id}")
        return res

    def get_reservation(self, sandbox_id: str) -> Reservation:
        with self.store.read() as t:
            return self._reservation(t, validate_sandbox_id(sandbox_id))

    # ---- shim reports ---------------------------------------------------------------------------
    @property
    def _gated(self) -> bool:
        """Whether a device waits for Cubelet's own reading of the VMM's confinement (real shims)."""
        return self.shim.host_devices and self.config.require_vmm_confinement

    def _confinement_problems(self, cp: ReservationCheckpoint, proof: VmmConfined) -> list[str]:
        """Cubelet's own /proc reading of the VMM the shim vouched for (the pid it started, the uid it claims)."""
        if cp.vmm_pid is None or proof.pid != cp.vmm_pid:
            return [f"confinement proof for pid {proof.pid!r}, VMM started as {cp.vmm_pid!r}"]
        return confine.cubelet_verdict(cp.vmm_pid, proof.uid)

    def handle_report(self, report: ShimReport) -> None:
        """Record a shim's report (its kind's handler updates the checkpoint and devices), judge readiness, then
        act on it outside the transaction (a teardown takes the lock itself)."""
        with self.change() as t:  # the lock covers the transaction; teardown takes it itself
            res = self._accepted_report(t, report)
            if res is None:
                return
            sid, cp = res.sandbox_id, res.checkpoint
            unconfined = self._unproven(report.kind, cp)
            if not unconfined and (record := _REPORT_RECORDERS.get(report.kind)) is not None:
                unconfined = record(self, t, res, report)
            violations = self._judge_guest(t, res, report)
            ready = (
                report.kind is ShimReportKind.GUEST_VALIDATED
                and not violations
                and res.phase is P.STARTING
                and all(d.state is S.ATTACHED for d in self._sandbox_devices(t, sid))
                and (cp.vmm_confined or not self._gated)  # a sandbox with no device to gate is gated here
            )
            warm = cp.warm_pool is not None and cp.claimed_at is None
            if ready:  # ready means ready: every device attached *and* validated in the guest
                res.fire(RE.WARMED if warm else RE.READY)
                t.event(EventKind.SANDBOX_WARM if warm else EventKind.SANDBOX_RUNNING, Actor.CUBELET, sandbox_id=sid)
            t.update_reservation(res)
        if unconfined:  # the VMM gets no device: the start fails and what it holds goes through the release path
            self.release_path.begin_teardown(
                sid,
                "vmm.not_confined",
                attach_failed=True,
                layer="backend",
                message=f"Cubelet's /proc check of the VMM: {'; '.join(unconfined)}"[:500],
            )
        elif ready and not warm:  # a warm sandbox is the node's: CubeMaster has no record of it
            self.release_path.notify(sid, StatusBody(phase="running"))
        elif (workload := self._workload_status(res, report)) is not None:
            self.release_path.notify(sid, workload)
        else:
            self._act_on_failure(res, report, violations)

    def _accepted_report(self, t: Tx, report: ShimReport) -> Reservation | None:
        """The reservation a report is evidence for, with the report recorded as an event; None when it is
        evidence of nothing (no reservation, or another start's report)."""
        res = t.reservation(report.sandbox_id) or t.reservation_of_shim(report.sandbox_id)  # a claimed warm shim
        sid = report.sandbox_id if res is None else res.sandbox_id  # reports under its own id
        expected = res.checkpoint.start_id if res else None
        if res is not None and (expected is None or report.start_id != expected):
            # A late report from an earlier start (reused sandbox id), a forged one, or one for a
            # reservation no shim serves yet (not started: no nonce to match): evidence of nothing.
            t.event(
                EventKind.SHIM_REPORT_REJECTED,
                Actor.SHIM,
                sandbox_id=sid,
                event=report.kind.value,
                reason="shim.report_stale",
                details={"start_id": report.start_id},
            )
            return None
        details = report.details if res else {**report.details, "reservation": "closed"}
        t.event(EventKind.SHIM_REPORT, Actor.SHIM, sandbox_id=sid, event=report.kind.value, details=details)
        return res

    def _unproven(self, kind: ShimReportKind, cp: ReservationCheckpoint) -> list[str]:
        """A device attached, or a sandbox ready, before Cubelet's own reading proved the VMM confined."""
        if not self._gated or cp.vmm_confined:
            return []
        if kind is ShimReportKind.DEVICE_ATTACHED:
            return ["no confinement proof before the device was attached"]
        if kind is ShimReportKind.GUEST_VALIDATED:
            return ["no confinement proof before the sandbox was ready"]  # one with no device, too
        return []

    def _on_vm_started(self, t: Tx, res: Reservation, report: ShimReport) -> list[str]:
        res.checkpoint.vmm_pid = VmStarted.read(report.details).pid
        return []

    def _on_vmm_confined(self, t: Tx, res: Reservation, report: ShimReport) -> list[str]:
        if not self._gated:
            return []
        problems = self._confinement_problems(res.checkpoint, VmmConfined.read(report.details))
        res.checkpoint.vmm_confined = not problems
        return problems

    def _on_device_attached(self, t: Tx, res: Reservation, report: ShimReport) -> list[str]:
        named = set(report.device_ids)  # one report per device; none named means all
        address = DeviceAttached.read(report.details).guest_address
        for d in self._sandbox_devices(t, res.sandbox_id):
            if d.state is S.PREPARING and (not named or d.id in named):
                t.transition(d, E.ATTACH_SUCCEEDED, Actor.SHIM)
                if address is not None:
                    res.checkpoint.guest_addresses[d.id] = address
        return []

    def _on_device_detached(self, t: Tx, res: Reservation, report: ShimReport) -> list[str]:
        cp = res.checkpoint
        cp.detached = sorted(set(cp.detached) | set(report.device_ids or res.device_ids))
        return []

    def _on_shim_exiting(self, t: Tx, res: Reservation, report: ShimReport) -> list[str]:
        res.checkpoint.shim_exited = True
        return []

    def _on_workload_unresponsive(self, t: Tx, res: Reservation, report: ShimReport) -> list[str]:
        """The first report of a stall keeps its time: a repeated one does not move `since`."""
        cp = res.checkpoint
        if cp.workload_unresponsive_since is None:
            cp.workload_unresponsive_since = report.at or time.time()
        cp.workload_reason = (WorkloadUnresponsive.read(report.details).reason or "workload.unresponsive")[:200]
        return []

    def _on_workload_recovered(self, t: Tx, res: Reservation, report: ShimReport) -> list[str]:
        res.checkpoint.workload_unresponsive_since = res.checkpoint.workload_reason = None
        return []

    def _workload_status(self, res: Reservation, report: ShimReport) -> StatusBody | None:
        """The push a workload report makes for a sandbox CubeMaster has a record of (not a warm one's)."""
        if report.kind not in (ShimReportKind.WORKLOAD_UNRESPONSIVE, ShimReportKind.WORKLOAD_RECOVERED):
            return None
        cp = res.checkpoint
        if res.phase not in (P.STARTING, P.RUNNING) or (cp.warm_pool is not None and cp.claimed_at is None):
            return None
        if cp.workload_unresponsive_since is None:
            since = report.at or time.time()
            message = WorkloadRecovered.read(report.details).message
            back = WorkloadCondition(state="answering", since=since, message=message and message[:2000])
            return StatusBody(phase="running", workload=back)
        message = WorkloadUnresponsive.read(report.details).message
        condition = WorkloadCondition(
            state="unresponsive",
            reason=cp.workload_reason,
            since=cp.workload_unresponsive_since,
            message=message and message[:2000],
        )
        return StatusBody(phase="running", workload=condition)

    def _act_on_failure(self, res: Reservation, report: ShimReport, violations: list[ContractViolation]) -> None:
        """What a report that is not a readiness means for the sandbox: a failed start or a dead VMM is torn down;
        the shim's final report lets a release finish. detach_timeout and vmm_exited during a release are
        history (the shim_report event), not release evidence."""
        sid, k = res.sandbox_id, report.kind
        if k is ShimReportKind.ATTACH_FAILED:
            failed = StartFailed.read(report.details)
            self.release_path.begin_teardown(
                sid,
                failed.reason or "attach_failed",
                attach_failed=True,
                layer=failed.layer or "backend",
                message=failed.message or "",
            )
        elif k is ShimReportKind.GUEST_VALIDATION_FAILED or violations:
            reason, layer, message = _guest_failure(StartFailed.read(report.details), violations)
            self.release_path.begin_teardown(sid, reason, layer=layer, message=message)
        elif k is ShimReportKind.VMM_EXITED:
            self.release_path.begin_teardown(sid, "vmm_exited", message="the VMM exited while the sandbox was in use")
        elif k is ShimReportKind.SHIM_EXITING and res.phase is P.RELEASING:
            # the final report is release evidence: no waiting for the next reconcile pass
            self.release_path.try_release(sid)

    def _judge_guest(self, t: Tx, res: Reservation, report: ShimReport) -> list[ContractViolation]:
        """Stage 5, judged again on the host: the agent's own verdict is not trusted alone."""
        contract = res.params.contract
        if report.kind not in (ShimReportKind.GUEST_VALIDATED, ShimReportKind.GUEST_VALIDATION_FAILED):
            return []
        raw = GuestValidated.read(report.details).report
        if report.kind is ShimReportKind.GUEST_VALIDATION_FAILED and raw is None:
            return []  # the agent could not even probe: the shim's own reason decides
        try:
            if raw is None:  # a pass without facts is no pass: every sandbox is validated
                raise ValueError("no guest report")
            guest = GuestReport.from_json(raw)
        except (KeyError, TypeError, ValueError, OverflowError, RecursionError) as e:  # the guest wrote it
            t.event(
                EventKind.GUEST_CHECKED,
                Actor.CUBELET,
                sandbox_id=res.sandbox_id,
                reason="guest.report_malformed",
                details={"error": str(e)},
            )
            return [ContractViolation(Layer.GUEST_KERNEL, "guest.report_malformed", "a GuestReport", str(e))]
        if contract is None:
            violations = check_minimal(self._sandbox_devices(t, res.sandbox_id), res.checkpoint.guest_addresses, guest)
        else:
            violations = check_guest(contract, guest)
        t.event(
            EventKind.GUEST_CHECKED,
            Actor.CUBELET,
            sandbox_id=res.sandbox_id,
            reason=violations[0].code if violations else None,
            details={"violations": [v.to_json() for v in violations]},
        )
        return violations

    # ---- release --------------------------------------------------------------------------------
    def release(self, sandbox_id: str, reason: str = "sandbox_deleted") -> Reservation | None:
        validate_sandbox_id(sandbox_id)
        self.get_reservation(sandbox_id)  # 404 when unknown
        self.release_path.begin_teardown(sandbox_id, reason)
        return self.store.reservation(sandbox_id)


ReportRecorder = Callable[[Cubelet, Tx, Reservation, ShimReport], list[str]]

# What each kind of shim report changes in the journal; a kind not here is history only (its event).
_REPORT_RECORDERS: dict[ShimReportKind, ReportRecorder] = {
    ShimReportKind.VM_STARTED: Cubelet._on_vm_started,
    ShimReportKind.VMM_CONFINED: Cubelet._on_vmm_confined,
    ShimReportKind.DEVICE_ATTACHED: Cubelet._on_device_attached,
    ShimReportKind.DEVICE_DETACHED: Cubelet._on_device_detached,
    ShimReportKind.SHIM_EXITING: Cubelet._on_shim_exiting,
    ShimReportKind.WORKLOAD_UNRESPONSIVE: Cubelet._on_workload_unresponsive,
    ShimReportKind.WORKLOAD_RECOVERED: Cubelet._on_workload_recovered,
}


def _guest_failure(failed: StartFailed, violations: list[ContractViolation]) -> tuple[str, str, str]:
    """(reason, layer, message) of a start the guest failed: the host's own judgement first, else the shim's."""
    if violations:
        v = violations[0]
        return v.code, v.layer.value, f"expected {v.expected}, found {v.found}"
    layer = failed.layer or (str(failed.failed_layers[0]) if failed.failed_layers else "guest_kernel")
    reason = failed.reason or "guest.validation_failed"
    return reason, layer, failed.message or "the guest does not satisfy the contract"
