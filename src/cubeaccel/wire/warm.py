"""Warm sandboxes on the wire (docs/warm.md): the claim Cubelet sends a warm shim, the shim's answer, and the
Cubelet API's pool bodies. A claim's request body is `ReservationBody` itself: a claim is a reservation request
that may be served only from the pool."""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import Field, SecretStr, StrictBool, StrictInt, StrictStr

from cubeaccel.wire.base import Count, Lenient, LenientMessage, Message, Record, Reply
from cubeaccel.wire.cubelet_api import ReservationBody
from cubeaccel.wire.frozen_contract import Contract

WARM_ID_PREFIX = "warm-"  # a warm sandbox's own id: the node's namespace, never a requester's
WARM_ID = r"^warm-[0-9a-f]{16}$"
MAX_CONTROL_LINE = 4096  # one JSON line each way on a shim's `control.sock`
RNG_SEED = r"^[0-9a-f]{64}$"  # 32 random bytes, hex


class ShimClaim(Message):
    """Cubelet → warm shim, one line on `control.sock`: the tenant's workload token (the bridge rebinds to it)
    and 32 random bytes the guest mixes into its RNG before any tenant command runs."""

    sandbox_id: StrictStr = Field(max_length=63)  # the id it is claimed as (the shim keeps running under its own)
    workload_token: SecretStr = Field(min_length=32, max_length=200)
    rng_seed: Annotated[StrictStr, Field(pattern=RNG_SEED)]

    def line(self) -> bytes:
        """The message as sent: the one place the token is written out (to the shim's socket, never to disk)."""
        body = {**self.model_dump(mode="json"), "workload_token": self.workload_token.get_secret_value()}
        return json.dumps(body).encode() + b"\n"


class ShimClaimAck(Message):
    """Warm shim → Cubelet: the bridge serves the new token (its guest answered /health under it), or why not."""

    ok: StrictBool
    code: StrictStr | None = None
    message: StrictStr = ""
    rebind_ms: float | None = None  # the bridge's rebind to the new token, until the guest answered under it
    reseed_ms: float | None = None  # the guest RNG reseed before it
    reseeded: StrictBool = False


class WarmPoolBody(Message):
    """`PUT /v1/warm/pools`: keep `size` warm sandboxes of this request's shape (0 empties the pool). The shape
    fields are `ReservationBody`'s: the pool key is derived from them exactly as a claim's is."""

    size: StrictInt = Field(ge=0, le=64)
    count: StrictInt = 1
    accel_class: str | None = Field(default=None, alias="class", max_length=32)
    memory_mib: StrictInt = 512
    vcpus: StrictInt = Field(default=1, ge=1, le=256)
    pin_memory: StrictBool = True
    contract: Contract = Field(title="Contract")
    template: str | None = Field(default=None, max_length=200)


class WarmPoolSetting(Message):
    """One pool as the Cubelet's journal keeps it (`WarmSettings`): the shape `PUT /v1/warm/pools` or `--warm`
    gave, and its size. A pool of a request with no contract (a CPU-only shape) keeps None."""

    size: StrictInt = Field(ge=0, le=64)
    count: StrictInt = 1
    accel_class: str | None = Field(default=None, alias="class", max_length=32)
    memory_mib: StrictInt = 512
    vcpus: StrictInt = Field(default=1, ge=1, le=256)
    pin_memory: StrictBool = True
    contract: dict[str, Any] | None = None
    template: str | None = Field(default=None, max_length=200)


class WarmSettings(Message):
    """The node's warm pools and its drain, in the Cubelet's journal (`meta` key `warm`): a restarted Cubelet
    keeps the pools it was given and stays drained until undrained (docs/warm.md)."""

    draining: StrictBool = False
    pools: list[WarmPoolSetting] = []


class WarmPoolView(Reply):
    key: str
    template: str | None
    size: int  # wanted
    warm: int  # ready to claim now
    starting: int
    claims: int
    misses: int
    failures: int  # warm starts that failed (the refill backs off)
    backoff_s: float
    # The refill's last start was refused for capacity (that code): it waits for a device to come back, not
    # counted as a failure, not backed off. None: not waiting.
    waiting_for: str | None = None


class WarmPoolList(Reply):
    pools: list[WarmPoolView]
    max_concurrent_starts: int
    draining: bool = False


class WarmDrainReply(Reply):
    """`POST /v1/warm/drain` (a node drain, `cubeaccel down`): refilling and claims stop; these unclaimed warm
    sandboxes entered the release path. `POST /v1/warm/undrain` answers the same with none."""

    draining: bool
    torn_down: list[str]


class WarmVerbFailure(Record):
    """In CubeMaster's drain/undrain reply instead of `WarmDrainReply`: the node's state changed, but its Cubelet
    could not be asked to drain (or undrain) its warm pools; the code and message say why."""

    error: str
    message: str


class WarmClaimBody(ReservationBody):
    """`POST /v1/warm/claim`: a reservation request served only from the pool. `warm_id` names the warm sandbox
    to take (CubeMaster's claim row is keyed on it, so two replicas never send one id for two sandboxes); None:
    the pool's oldest. The Cubelet's journal CAS decides either way: an id no longer warm is a miss."""

    warm_id: str | None = Field(default=None, pattern=WARM_ID)


class WarmSandboxFact(Lenient):
    """One warm sandbox, ready to claim, as the heartbeat advertises it."""

    id: Annotated[StrictStr, Field(pattern=WARM_ID)]
    labels: dict[str, str] = {}  # its devices' summary labels: the capacity group they come from


class WarmPoolFact(LenientMessage):
    """One warm pool in the heartbeat (`Heartbeat.warm_pools`): its shape, as the Cubelet derives the pool key
    (`cubelet/warm.py::pool_key`), so CubeMaster matches a create field by field, and its counts."""

    key: StrictStr
    template: str | None = None
    contract_digest: StrictStr
    accel_class: str | None = Field(default=None, alias="class")
    count: Count
    memory_mib: Count
    vcpus: Count
    pin_memory: StrictBool = True
    network: dict[str, Any] | None = None  # the effective policy (`NetworkPolicy.to_json`); None: no NIC
    size: Count  # wanted
    warm: Count  # ready to claim now (their ids in `sandboxes`)
    starting: Count
    sandboxes: list[WarmSandboxFact] = []
