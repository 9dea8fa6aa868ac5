"""Cubelet HTTP request and reply bodies (docs/api.md). Requests are strict; replies type what they document."""

from __future__ import annotations

from typing import Any, Literal, Self

from pydantic import Field, SecretStr, StrictBool, StrictInt

from cubeaccel.model import bars
from cubeaccel.model.bars import BarKind
from cubeaccel.model.checkpoint import ReservationCheckpoint, SandboxFailure
from cubeaccel.model.device import AcceleratorClass, DeviceIdentity, DeviceRecord, PciAddress
from cubeaccel.model.limits import MAX_MEMORY_MIB, MIN_MEMORY_MIB
from cubeaccel.model.reservation_params import ReservationParams
from cubeaccel.model.reservation_states import ReservationPhase
from cubeaccel.model.states import DeviceState
from cubeaccel.wire.base import Message, Record, Reply, Sparse
from cubeaccel.wire.frozen_contract import Contract, Network


class ReservationBody(Message):
    sandbox_id: str = Field(max_length=63)
    count: StrictInt = 1
    accel_class: str | None = Field(default=None, alias="class", max_length=32)
    labels: dict[str, str] = Field(default_factory=dict, max_length=32)
    template: str | None = Field(default=None, max_length=200)
    memory_mib: StrictInt = Field(default=512, ge=MIN_MEMORY_MIB, le=MAX_MEMORY_MIB)
    vcpus: StrictInt = Field(default=1, ge=1, le=256)
    pin_memory: StrictBool = True
    # Parsed here; the Cubelet re-checks it (it crossed a process boundary).
    contract: Contract | None = Field(default=None, title="Contract")
    lifetime_s: float | None = Field(default=None, gt=0, le=31 * 86400)  # None: the Cubelet's default
    start: StrictBool = False
    # The start's workload token when the caller chose it (CubeMaster passes the creator's on); None: a fresh one.
    workload_token: SecretStr | None = Field(default=None, min_length=32, max_length=200)
    # Narrows the contract's network policy (model/sandbox_policy.py); the Cubelet derives the effective one.
    network: Network | None = Field(default=None, title="Network")
    # Whose sandbox it is, for the node's audit trail (who had which device). Absent from an older CubeMaster and
    # from local callers: the assignment is then audited with tenant null.
    tenant: str | None = Field(default=None, min_length=1, max_length=128)
    # When the devices that fit are being released or scrubbed on this node: wait for them this long, in arrival
    # order, before refusing (cubelet/capacity_wait.py). None: refuse at once. CubeMaster sends it only to a
    # Cubelet whose heartbeat says `reserve_waits`.
    capacity_wait_s: float | None = Field(default=None, ge=0, le=600)


class NetworkUpdateBody(Message):
    """`PUT /v1/reservations/{id}/network`: a running sandbox's new narrowing of its template's network policy,
    whole (it replaces the create's); the Cubelet derives the effective policy again and loads it in place."""

    network: Network = Field(title="Network")


class OperatorBody(Message):
    who: str = Field(min_length=1, max_length=200)
    reason: str = Field(min_length=1, max_length=2000)
    restore_driver: StrictBool = False  # disable only: give the device back to its original host driver


class Bar(Record):
    """One BAR of a device as discovery saw it (model/bars.py)."""

    index: int
    size: int
    kind: BarKind
    prefetch: bool

    @classmethod
    def of(cls, bar: bars.Bar) -> Bar:
        return cls(index=bar.index, size=bar.size, kind=bar.kind, prefetch=bar.prefetch)

    def model(self) -> bars.Bar:
        return bars.Bar(self.index, self.size, self.kind, self.prefetch)


# A device's identity; master/auth.Identity is a caller's (role, tenant, node): same word, unrelated.
class Identity(Record):
    """What a device is, in the hex spellings `lspci -n` uses."""

    vendor_id: str
    device_id: str
    subsystem_vendor_id: str
    subsystem_device_id: str
    class_code: str
    revision: str
    serial: str | None
    bars: list[Bar]

    @classmethod
    def of(cls, ident: DeviceIdentity) -> Identity:
        return cls(
            vendor_id=f"{ident.vendor_id:04x}",
            device_id=f"{ident.device_id:04x}",
            subsystem_vendor_id=f"{ident.subsystem_vendor_id:04x}",
            subsystem_device_id=f"{ident.subsystem_device_id:04x}",
            class_code=f"{ident.class_code:06x}",
            revision=f"{ident.revision:02x}",
            serial=ident.serial,
            bars=[Bar.of(b) for b in ident.bars],
        )

    def model(self) -> DeviceIdentity:
        return DeviceIdentity(
            vendor_id=int(self.vendor_id, 16),
            device_id=int(self.device_id, 16),
            subsystem_vendor_id=int(self.subsystem_vendor_id, 16),
            subsystem_device_id=int(self.subsystem_device_id, 16),
            class_code=int(self.class_code, 16),
            revision=int(self.revision, 16),
            serial=self.serial,
            bars=tuple(b.model() for b in self.bars),
        )


class Device(Record):
    """One device as the store holds it."""

    id: str
    address: str
    state: DeviceState
    sandbox_id: str | None
    reason: str | None
    labels: dict[str, str]
    accel_class: AcceleratorClass = Field(validation_alias="class", serialization_alias="class")
    backend: str
    numa_node: int
    iommu_group: int | None
    expected_driver: str | None
    identity: Identity
    generation: int
    updated_at: float

    @classmethod
    def of(cls, d: DeviceRecord) -> Self:
        return cls(
            id=d.id,
            address=str(d.address),
            state=d.state,
            sandbox_id=d.sandbox_id,
            reason=d.reason,
            labels=dict(d.labels),
            accel_class=d.accel_class,
            backend=d.backend,
            numa_node=d.numa_node,
            iommu_group=d.iommu_group,
            expected_driver=d.expected_driver,
            identity=Identity.of(d.identity),
            generation=d.generation,
            updated_at=d.updated_at,
        )

    def record(self) -> DeviceRecord:
        """The record as the Cubelet's store holds it (a client that judges devices as the Cubelet does)."""
        return DeviceRecord(
            id=self.id,
            address=PciAddress.parse(self.address),
            identity=self.identity.model(),
            accel_class=self.accel_class,
            backend=self.backend,
            numa_node=self.numa_node,
            iommu_group=self.iommu_group,
            expected_driver=self.expected_driver,
            labels=dict(self.labels),
            state=self.state,
            generation=self.generation,
            reason=self.reason,
            sandbox_id=self.sandbox_id,
            updated_at=self.updated_at,
        )


class DeviceReply(Device):
    v: Literal[1] = 1


class JournalEvent(Record):
    """One row of the node's journal, without its details. `kind` names what happened (a device transition, a
    shim report, a repair, …); the vocabulary grows with the code, so it stays a string."""

    seq: int
    at: float
    kind: str
    device_id: str | None
    sandbox_id: str | None
    event: str | None
    from_state: str | None
    to_state: str | None
    actor: str
    reason: str | None


# The API's form of cubelet/store.Event (the journal's row): model/ and the store hold no pydantic.
class Event(JournalEvent):
    """A journal row with `details`, the event's own facts."""

    details: dict[str, Any]


class TimelineEntry(Record):
    at: float
    kind: str
    event: str | None
    device_id: str | None
    to_state: str | None


class Failure(Record):
    """Why a sandbox failed (model/checkpoint.SandboxFailure)."""

    code: str
    layer: str
    message: str
    phase: str  # the reservation phase it failed in

    @classmethod
    def of(cls, f: SandboxFailure) -> Failure:
        return cls(code=f.code, layer=f.layer, message=f.message, phase=f.phase)


class _CheckpointHead(Record):
    v: int
    shim_started: bool
    started_at: float | None


class _StartNonce(Record):
    start_id: str | None


class _CheckpointRest(Record):
    image_digest: str | None
    workload_token_sha256: str | None
    warm_pool: str | None
    shim_id: str | None
    claimed_at: float | None
    claim_acked: bool
    vmm_pid: int | None
    vmm_confined: bool
    guest_addresses: dict[str, str]
    detached: list[str]
    shim_exited: bool
    # set while the shim says the workload service does not answer: since when, and the code calls fail with
    workload_unresponsive_since: float | None = None
    workload_reason: str | None = None
    failure: Failure | None
    network: dict[str, Any] | None  # host/netpolicy.SandboxNet as the release path reads it back
    kill_at: float | None
    vmm_survives: bool
    release_waits: dict[str, list[str]]


# Bases are listed last-first: pydantic orders fields from the deepest base, so the nonce keeps its place
# (after `started_at`) in the unix socket's JSON.
class Checkpoint(_CheckpointRest, _CheckpointHead):
    """A start's checkpoint (model/checkpoint.ReservationCheckpoint), served as the reservation's `facts`, over
    TCP without the start nonce: only the root-only unix socket shows it (`LocalCheckpoint`)."""

    @classmethod
    def of(cls, c: ReservationCheckpoint) -> Checkpoint:
        return cls(**_checkpoint_fields(c))


class LocalCheckpoint(_CheckpointRest, _StartNonce, _CheckpointHead):
    """The unix socket's: with the nonce that makes a shim report count (`start_id`)."""

    @classmethod
    def of(cls, c: ReservationCheckpoint) -> LocalCheckpoint:
        return cls(**_checkpoint_fields(c), start_id=c.start_id)


def _checkpoint_fields(c: ReservationCheckpoint) -> dict[str, Any]:
    return {
        "v": c.v,
        "shim_started": c.shim_started,
        "started_at": c.started_at,
        "image_digest": c.image_digest,
        "workload_token_sha256": c.workload_token_sha256,
        "warm_pool": c.warm_pool,
        "shim_id": c.shim_id,
        "claimed_at": c.claimed_at,
        "claim_acked": c.claim_acked,
        "vmm_pid": c.vmm_pid,
        "vmm_confined": c.vmm_confined,
        "guest_addresses": dict(c.guest_addresses),
        "detached": list(c.detached),
        "shim_exited": c.shim_exited,
        "workload_unresponsive_since": c.workload_unresponsive_since,
        "workload_reason": c.workload_reason,
        "failure": None if c.failure is None else Failure.of(c.failure),
        "network": None if c.network is None else dict(c.network),
        "kill_at": c.kill_at,
        "vmm_survives": c.vmm_survives,
        "release_waits": {k: list(v) for k, v in c.release_waits.items()},
    }


class EffectiveNetwork(Sparse):
    """A sandbox's effective network policy (model/sandbox_policy.NetworkPolicy) as its reservation stored it;
    `mode: none` has no `egress`."""

    egress: list[str] = []  # sorted keys, as the journal holds them
    mode: Literal["none", "allowlist"]


class ReservationParamsShown(Sparse):
    """The reservation request as the Cubelet stored it (model/reservation_params.ReservationParams). Fields are
    in sorted order, as the journal's row is; `network` and `tenant` are absent when unset. The frozen contract
    stays the JSON it arrived as: the Cubelet and the shim parse it where they use it, CubeMaster never does.
    The defaults are `ReservationParams`'s, for a field an older Cubelet's row did not hold."""

    accel_class: str | None = Field(default=None, alias="class")
    contract: dict[str, Any] | None = None  # model/reservation_params.CarriedContract, as carried
    count: int = 1
    labels: dict[str, str] = {}
    lifetime_s: int | float | None = None  # as stored: an int stays one
    memory_mib: int = 512
    network: EffectiveNetwork | None = None
    pin_memory: bool = True
    template: str | None = None
    tenant: str | None = None
    vcpus: int = 1

    @classmethod
    def of(cls, p: ReservationParams) -> ReservationParamsShown:
        return cls.model_validate(p.as_stored())


# The API's form of cubelet/store.Reservation (the journal's row), with the params shown, not stored.
class Reservation(Record):
    """A sandbox's claim on devices, with its start's checkpoint (`facts`)."""

    sandbox_id: str
    params: ReservationParamsShown
    device_ids: list[str]
    phase: ReservationPhase
    created_at: float
    expires_at: float | None
    facts: LocalCheckpoint | Checkpoint
    releasing_since: float | None


class Health(Reply):
    status: Literal["ok"]
    node: str
    schema_version: int


class DeviceList(Reply):
    devices: list[Device]


class WarmHandOff(Record):
    """A warm claim's hand-off in the shim, timed (docs/warm.md): the guest RNG reseed, then the bridge's rebind
    to the tenant's token; what a create's timeline shows of the warm path."""

    reseed_ms: float | None
    rebind_ms: float | None
    reseeded: bool


class ReservationView(Reply):
    """A sandbox's reservation (None once released), its devices, its timeline and why it failed, if it did."""

    sandbox_id: str
    reservation: Reservation | None
    devices: list[Device]
    timeline: list[TimelineEntry]
    failure: Failure | None
    # The workload access token of the start this reply reports, given once (only its hash is kept); else None.
    access_token: str | None = None
    hand_off: WarmHandOff | None = None  # a warm claim's reply only


class ReservationList(Reply):
    reservations: list[Reservation]


class Release(Reply):
    sandbox_id: str
    released: bool  # false: the release is under way (202); poll the reservation
    reservation: Reservation | None
    devices: list[Device]


class Accepted(Reply):
    accepted: bool


class EventPage(Reply):
    events: list[Event]
    next: int  # the cursor for the next page (`since`)


# One shape on both APIs: the Cubelet's readiness and CubeMaster's node view (master_api imports it). The
# heartbeat's is a second class on purpose: it reads what a node sends leniently (wire/heartbeat.py).
class HostProblem(Record):
    code: str
    message: str


class PinnedMemory(Record):
    """The pinned-memory ledger (cubelet/memory_ledger.py)."""

    lockable_mib: int
    locked_mib: int
    free_mib: int
    source: str
    per_vmm_limit_mib: int | None
    vmm_overhead_mib: int
    vmm_overhead_per_vcpu_mib: int
    sandboxes: dict[str, int]  # sandbox id → MiB it locks


class HostReply(Reply):
    node: str
    backend: str
    ready: bool
    checked_at: float | None
    problems: list[HostProblem]
    pinned_memory: PinnedMemory


# The API's form of cubelet/reconcile.Repair, which reconcile builds without pydantic.
class Repair(Record):
    device_id: str | None
    sandbox_id: str | None
    what: str
    why: str


class Repairs(Reply):
    repairs: list[Repair]
