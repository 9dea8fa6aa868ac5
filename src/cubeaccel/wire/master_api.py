"""CubeMaster HTTP request and reply bodies (docs/master.md). Requests are strict; replies type what they document."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AliasChoices, ConfigDict, Field, StrictInt, StringConstraints

from cubeaccel.model.limits import MAX_MEMORY_MIB, MIN_MEMORY_MIB
from cubeaccel.model.sandbox_states import NodeState, SandboxState
from cubeaccel.wire.base import Message, Record, Reply, Sparse, Strict
from cubeaccel.wire.cubelet_api import Device, DeviceReply, HostProblem
from cubeaccel.wire.warm import WarmDrainReply, WarmVerbFailure


class StatusError(Strict):
    code: str = Field(min_length=1, max_length=200)
    layer: str = Field(min_length=1, max_length=64)
    message: str = Field(default="", max_length=2000)
    phase: str | None = Field(default=None, max_length=32)  # the Cubelet phase it failed in


class WorkloadCondition(Strict):
    """Whether the sandbox's workload service answers its shim (docs/decisions.md: a condition beside the state,
    not a state): `unresponsive` since `since` (the Cubelet's clock when the shim said so) with the code its calls
    now fail with, or `answering` again. A sandbox's record shows it only while `unresponsive`."""

    state: Literal["unresponsive", "answering"]
    reason: str | None = Field(default=None, max_length=200)  # a catalog code, e.g. workload.unresponsive
    since: float
    message: str | None = Field(default=None, max_length=2000)


class StatusBody(Message):
    """Cubelet's push for one sandbox: ready (guest validated), or failed with code and layer; with `workload`
    (phase `running`), only its workload service's condition changed."""

    phase: Literal["running", "failed"]
    error: StatusError | None = None
    workload: WorkloadCondition | None = None


MAX_LIFETIME_S = 30 * 86400.0  # no sandbox lives longer, whatever its tenant's quota says
MetaKey = Annotated[str, StringConstraints(min_length=1, max_length=256)]
MetaValue = Annotated[str, StringConstraints(max_length=2048)]
EnvName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,255}$")]
EnvValue = Annotated[str, StringConstraints(max_length=32768)]


class SandboxBody(Message):
    id: str | None = None
    template: str | None = Field(default=None, min_length=1, max_length=401)
    accelerators: Any = None
    gpu: Any = None
    memory_mib: StrictInt | None = Field(default=None, ge=MIN_MEMORY_MIB, le=MAX_MEMORY_MIB)
    vcpus: StrictInt = Field(default=1, ge=1, le=256)
    timeout_s: float | None = Field(default=None, gt=0, le=MAX_LIFETIME_S)
    tenant: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # a tenant key's own
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=200)
    # Labels stored with the sandbox and returned (the E2B front door filters its list by them).
    metadata: dict[MetaKey, MetaValue] = Field(default_factory=dict, max_length=64)
    # Environment for every command in the sandbox (E2B `envVars`: the front door applies them to each command).
    env_vars: dict[EnvName, EnvValue] = Field(default_factory=dict, max_length=256)
    # The workload token the start gives the guest, when the caller derives its own (the E2B front door does, to
    # hand it out again on connect); passed to the Cubelet, never stored. None: the Cubelet makes one.
    workload_token: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_-]{32,200}$", repr=False)
    # Narrows the template's network policy ({"mode": "allowlist", "egress": [...]}, {"mode": "none"}, or by address
    # alone: {"allow_out": [CIDR], "deny_out": [CIDR]}, model/sandbox_policy.AddressNarrowing); never widens.
    network: dict[str, Any] | None = None


# CubeMaster's body (seconds as a float, `timeout_s`); wire/e2b_api.TimeoutBody is E2B's (`timeout`, int).
class TimeoutBody(Message):
    timeout_s: float = Field(gt=0, le=MAX_LIFETIME_S)


class NetworkBody(Message):
    """`PUT /v1/sandboxes/{id}/network`: a running sandbox's new narrowing of its template's network policy, as a
    create's `network` (rules of its own, or `allow_out`/`deny_out`); it replaces the create's whole."""

    network: dict[str, Any]


# CubeMaster's own body (reason optional); wire/cubelet_api.OperatorBody requires one.
class OperatorBody(Message):
    """Like the Cubelet's operator body, but `reason` may be left out (node verbs need none); empty is a 422."""

    who: str = Field(default="operator", min_length=1, max_length=200)
    reason: str | None = Field(default=None, min_length=1, max_length=2000)


class DefaultBody(Message):
    template: str = Field(min_length=1, max_length=200)


# CubeMaster's own /health; wire/cubelet_api.Health is the Cubelet's, a different body on another API.
class Health(Reply):
    status: Literal["ok"]
    schema_version: int
    db: str
    errors: list[Any]  # the maintenance loop's last errors


class HeartbeatAck(Reply):
    node: str
    state: NodeState


ClassField = Field(validation_alias=AliasChoices("class", "accel_class"), serialization_alias="class")


class NodeGroup(Record):
    """One capacity group of the node (devices of one class with equal summary labels)."""

    accel_class: str = ClassField
    labels: dict[str, str]
    total: int
    allocatable: int  # free after this cluster's claims
    claimed: int  # placed here, not yet in the node's summary
    allocatable_by_numa: dict[str, int]


class WarmPoolShown(Record):
    key: str
    template: str | None
    accel_class: str | None = ClassField
    count: int
    memory_mib: int
    vcpus: int
    size: int  # wanted
    warm: int  # ready now
    starting: int
    claimable: int  # warm and held by no claim row of this cluster
    sandboxes: list[str]


class PinnedLedger(Sparse):
    """A node's pinned-memory ledger as its heartbeat sent it (cubelet/memory_ledger.Ledger.to_json): a field an
    older Cubelet did not send stays absent, one a newer Cubelet added passes through."""

    lockable_mib: int | None = None
    locked_mib: int | None = None
    free_mib: int | None = None
    source: str | None = None
    per_vmm_limit_mib: int | None = None
    vmm_overhead_mib: int | None = None
    vmm_overhead_per_vcpu_mib: int | None = None
    sandboxes: dict[str, int] | None = None  # sandbox id → MiB it locks


class PinnedMemoryShown(PinnedLedger):
    """The ledger with this cluster's claims: what is placed there that the ledger cannot show yet."""

    claimed_mib: int
    free_after_claims_mib: int


class GuestImage(Record):
    """A guest the node can boot (model/node_facts.GuestImageFact)."""

    digest: str
    kernel_release: str
    kernel_digests: list[str]
    modules_img_digest: str


# The node list's row; model/contract.NodeSummary is what placement judges a node by (its device labels,
# guest images, hot-plug paths), built by the scheduler from its node view, not from this.
class NodeSummary(Record):
    node: str
    cubelet_url: str
    version: str
    state: NodeState | Literal["stale"]  # the operator state, or `stale` (no recent heartbeat)
    schedulable: bool
    ready: bool
    host_problems: list[HostProblem]
    pinned_memory: PinnedMemoryShown
    last_heartbeat_age_s: float
    backends: list[str]
    pinnable_memory_mib: int
    guest_images: list[GuestImage]  # newest first
    hotplug: list[str]
    max_devices_per_sandbox: int | None = None  # None: the Cubelet did not say
    warm: int = 0
    warm_pools: list[WarmPoolShown] = []
    total: int
    allocatable: int
    groups: list[NodeGroup]


class NodeReply(NodeSummary):
    v: Literal[1] = 1


class NodeList(Reply):
    nodes: list[NodeSummary]


class NodeVerbReply(Reply):
    """drain/undrain: node, state, who, and `warm` (the Cubelet's `WarmDrainReply`, or why it could not be
    asked); reconcile: what the reconcile did (its own fields)."""

    node: str
    warm: WarmDrainReply | WarmVerbFailure | None = None


class ModelCapacity(Record):
    total: int
    allocatable: int


class Capacity(Reply):
    nodes: int
    schedulable_nodes: int
    by_state: dict[str, int]
    total: int
    allocatable: int
    models: dict[str, ModelCapacity]  # "class/model" → counts
    warm: dict[str, int] = {}  # template → warm sandboxes a matching create may claim (not in `allocatable`)


class TemplateRef(Record):
    name: str
    version: str
    accel_class: str = ClassField
    digest: str
    default: bool  # the class's default template


class TemplateRow(TemplateRef):
    created_at: float


class TemplateRegistered(TemplateRef):
    v: Literal[1] = 1
    backend: str
    created: bool  # false: the same document was registered before (idempotent)


class TemplateShown(TemplateRow):
    v: Literal[1] = 1
    versions: list[str]
    document: dict[str, Any]


class TemplateList(Reply):
    templates: list[TemplateRow]
    defaults: dict[str, str]  # class → template name


class TemplateDeleted(Reply):
    deleted: int
    template: str


class DefaultSet(Reply):
    accel_class: str = ClassField
    template: str


class SandboxTemplate(Record):
    name: str
    version: str | None
    digest: str | None  # the contract's template digest (None: a record without one)


class AcceleratorChoiceShown(Sparse):
    """One acceptable shape of a create's accelerator request (model/request.AcceleratorChoice.to_json)."""

    model_config = ConfigDict(serialize_by_alias=True)  # `class` in the stored row, whoever dumps it

    accel_class: str = Field(  # model/request.parse_accelerators's defaults, for a row without them
        default="gpu", validation_alias=AliasChoices("class", "accel_class"), serialization_alias="class"
    )
    count: int = 1
    selector: str | None = None  # CEL over the device's labels
    model: str | None = None  # a model label, exact or as a `MODEL-` prefix


class AcceleratorShown(AcceleratorChoiceShown):
    """A create's accelerator request (model/request.AcceleratorRequest.to_json): its first choice, then the
    alternatives tried in order."""

    alternatives: list[AcceleratorChoiceShown] = []


class SandboxRequest(Sparse):
    """The create request as stored with the sandbox (normalized): what it asked for, and the effective network
    policy. Fields a create did not give are left out, as they were stored."""

    template: str | None = None
    accelerators: list[AcceleratorShown] = []  # one per request
    memory_mib: int | None = None
    vcpus: int = 1
    timeout_s: float | None = None
    metadata: dict[str, str] = {}  # the caller's labels
    env_vars: dict[str, str] = {}
    network: dict[str, Any] | None = None  # the caller's narrowing, as given
    network_policy: dict[str, Any] | None = None  # the effective policy (model/sandbox_policy)


class SandboxError(Sparse):
    """Why the sandbox failed or could not be released: a catalogued code, and where it came from."""

    code: str | None = None
    layer: str | None = None
    message: str | None = None
    phase: str | None = None  # the Cubelet phase it failed in
    node: str | None = None


# A sandbox's phase on CubeMaster's timeline; wire/cubelet_api.TimelineEntry is one Cubelet journal step.
class TimelineEntry(Record):
    at: float
    phase: str  # and the phase's own detail fields (wire/sandbox_timeline.py)


class SandboxRecord(Record):
    """The fields a sandbox record and a node's warm sandbox share."""

    id: str
    tenant: str
    node: str | None
    accel_class: str | None = ClassField
    count: int | None
    device_ids: list[str]  # the node's device ids this sandbox was given (kept after delete: the audit's key)
    template: SandboxTemplate | None
    request: SandboxRequest | None
    error: SandboxError | None
    timeline: list[TimelineEntry]
    expires_at: float | None
    created_at: float
    updated_at: float


class Sandbox(SandboxRecord):
    """One sandbox record (master/service.sandbox_reply)."""

    state: SandboxState | Literal["unknown"]  # `unknown` while its node's heartbeats are stale
    last_known_state: SandboxState | None = None  # the stored state when `state` shows `unknown`
    workload: WorkloadCondition | None = None  # set while its workload service does not answer (live sandboxes)


class WarmSandbox(SandboxRecord):
    """A node's warm sandbox as CubeMaster lists it (`?state=warm`, the dashboard): state `warm`, tenant "", no
    request or timeline; `claimed` while a create's claim row holds it."""

    state: Literal["warm"]
    last_known_state: None = None
    pool: str
    labels: dict[str, str]
    claimed: bool


class SandboxReply(Sandbox):
    v: Literal[1] = 1
    # The create that started it gets the sandbox's workload access token, once (nothing stores it); else None.
    access_token: str | None = None


class StartPhase(Record):
    phase: str  # "VM up", "memory pinned", "device attached", "workload service up", "guest validated"
    event: str  # the node's event kind it comes from
    at: float


class WorkloadEndpoint(Reply):
    """`GET /v1/sandboxes/{id}/workload`: where the running sandbox's workload is reached (its node's Cubelet
    proxy, which checks the sandbox's own access token); for its tenant, without the admin-only node routes."""

    sandbox_id: str
    node: str
    url: str


class WorkloadConnection(WorkloadEndpoint):
    """`POST /v1/sandboxes/{id}/connect`: the running sandbox's workload endpoint and its access token, for the
    sandbox's owner (its tenant's key, or an admin's), as E2B's connect gives `envdAccessToken`. Audited."""

    access_token: str = Field(repr=False)


class SandboxEvents(Reply):
    """`GET /v1/sandboxes/{id}/events`: the start phases the node recorded (through CubeMaster)."""

    sandbox_id: str
    state: SandboxState
    phases: list[StartPhase]
    node_answered: bool  # False: no node yet, or it did not answer (the phases may be incomplete)


class SandboxList(Reply):
    sandboxes: list[Sandbox | WarmSandbox]


class StatusReply(Reply):
    state: SandboxState


# ---- identities (docs/security.md) ----------------------------------------------------------------------
class QuotaBody(Strict):
    max_sandboxes: StrictInt | None = Field(default=None, ge=0)
    max_accelerators: dict[str, StrictInt] = Field(default_factory=dict)  # by class
    max_pinned_mib: StrictInt | None = Field(default=None, ge=0)
    max_lifetime_s: float | None = Field(default=None, gt=0)
    default_lifetime_s: float | None = Field(default=None, gt=0)


class TenantBody(Message):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
    quota: QuotaBody = Field(default_factory=QuotaBody)


class TenantCreated(Reply):
    name: str
    key_id: str
    key: str  # shown once


class QuotaShown(Sparse):
    """A tenant's quota as stored (master/records.Quota.to_json); None is unlimited."""

    max_sandboxes: int | None = None
    max_accelerators: dict[str, int] = {}  # by class
    max_pinned_mib: int | None = None
    max_lifetime_s: int | float | None = None  # as stored: an int stays one
    default_lifetime_s: int | float | None = None


class TenantRow(Record):
    name: str
    quota: QuotaShown
    created_at: float
    revoked: bool
    keys: list[str]


class TenantList(Reply):
    tenants: list[TenantRow]


class KeyCreated(Reply):
    key_id: str
    key: str  # shown once
    tenant: str | None


class KeyRow(Record):
    key_id: str
    role: str
    tenant: str | None
    created_at: float


class KeyList(Reply):
    keys: list[KeyRow]


class Revoked(Reply):
    revoked: str


class NodeCredential(Reply):
    node: str
    token: str  # shown once; the Cubelet reads it from --node-token-file


class WhoAmI(Reply):
    role: str
    tenant: str | None
    node: str | None
    key_id: str | None
    sandbox_id_prefix: str | None = None  # a tenant's: the ids it chooses start with it (docs/security.md)


# ---- device verbs through CubeMaster (admin) -------------------------------------------------------------
class DeviceVerbBody(Message):
    """An admin's device verb, forwarded to the node's Cubelet; `who` there is the admin's key, not a claim."""

    reason: str = Field(min_length=1, max_length=2000)
    restore_driver: bool = False  # disable only


class NodeDevices(Reply):
    node: str
    devices: list[Device]  # the node's own reply, forwarded


class NodeDevice(Reply):
    node: str
    device: DeviceReply


class AuditSeal(Record):
    log: str  # the first 32 hex digits of the log's first entry's hash
    seq: int
    hash: str


class AuditSeals(Reply):
    seals: list[AuditSeal]
