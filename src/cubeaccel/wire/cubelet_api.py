"""Cubelet HTTP request and reply bodies (docs/api.md). Requests are strict; replies type what they document."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, SecretStr, StrictBool, StrictInt

from cubeaccel.model.limits import MAX_MEMORY_MIB, MIN_MEMORY_MIB
from cubeaccel.wire.base import Message, Record, Reply


class ReservationBody(Message):
    sandbox_id: str = Field(max_length=63)
    count: StrictInt = 1
    accel_class: str | None = Field(default=None, alias="class", max_length=32)
    labels: dict[str, str] = Field(default_factory=dict, max_length=32)
    template: str | None = Field(default=None, max_length=200)
    memory_mib: StrictInt = Field(default=512, ge=MIN_MEMORY_MIB, le=MAX_MEMORY_MIB)
    vcpus: StrictInt = Field(default=1, ge=1, le=256)
    pin_memory: StrictBool = True
    contract: dict[str, Any] | None = None
    lifetime_s: float | None = Field(default=None, gt=0, le=31 * 86400)  # None: the Cubelet's default
    start: StrictBool = False
    # The start's workload token when the caller chose it (CubeMaster passes the creator's on); None: a fresh one.
    workload_token: SecretStr | None = Field(default=None, min_length=32, max_length=200)
    network: dict[str, Any] | None = None  # narrows the contract's network policy (model/sandbox_policy.py)
    # Whose sandbox it is, for the node's audit trail (who had which device). Absent from an older CubeMaster and
    # from local callers: the assignment is then audited with tenant null.
    tenant: str | None = Field(default=None, min_length=1, max_length=128)


class OperatorBody(Message):
    who: str = Field(min_length=1, max_length=200)
    reason: str = Field(min_length=1, max_length=2000)
    restore_driver: StrictBool = False  # disable only: give the device back to its original host driver


class Device(Record):
    """`DeviceRecord.to_json()`: one device as the store holds it."""

    id: str
    address: str
    state: str
    sandbox_id: str | None
    reason: str | None
    labels: dict[str, str]
    accel_class: str = Field(alias="class")
    backend: str
    numa_node: int
    iommu_group: int | None
    expected_driver: str | None
    identity: dict[str, Any]
    generation: int
    updated_at: float


class DeviceReply(Device):
    v: Literal[1] = 1


class Event(Record):
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
    details: dict[str, Any]


class TimelineEntry(Record):
    at: float
    kind: str
    event: str | None
    device_id: str | None
    to_state: str | None


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
    reservation: dict[str, Any] | None
    devices: list[Device]
    timeline: list[TimelineEntry]
    failure: dict[str, Any] | None
    # The workload access token of the start this reply reports, given once (only its hash is kept); else None.
    access_token: str | None = None
    hand_off: WarmHandOff | None = None  # a warm claim's reply only


class ReservationList(Reply):
    reservations: list[dict[str, Any]]


class Release(Reply):
    sandbox_id: str
    released: bool  # false: the release is under way (202); poll the reservation
    reservation: dict[str, Any] | None
    devices: list[Device]


class Accepted(Reply):
    accepted: bool


class EventPage(Reply):
    events: list[Event]
    next: int  # the cursor for the next page (`since`)


class HostReply(Reply):
    node: str
    backend: str
    ready: bool
    checked_at: float | None
    problems: list[dict[str, Any]]
    pinned_memory: dict[str, Any]


class Repairs(Reply):
    repairs: list[dict[str, Any]]
