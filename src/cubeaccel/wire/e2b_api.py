"""The E2B REST bodies the front door reads and writes (docs/e2b.md), as the E2B SDK's generated client has them.

Requests are lenient: the SDK sends fields we ignore (`secure`, `mcp`, ...); the ones that ask for something we do
not do (`autoPause`, `volumeMounts`, network options with no equivalent) are refused by the front door, by name.
Replies carry E2B's camelCase names; they have no `v` (the SDK's schema has none).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

MetaKey = Annotated[str, StringConstraints(min_length=1, max_length=256)]
MetaValue = Annotated[str, StringConstraints(max_length=2048)]


class E2BRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)


class NewSandbox(E2BRequest):
    template_id: str = Field(alias="templateID", min_length=1, max_length=401)
    timeout: int | None = Field(default=None, ge=1, le=30 * 86400)  # seconds to live
    metadata: dict[MetaKey, MetaValue] | None = Field(default=None, max_length=64)
    env_vars: dict[str, str] | None = Field(default=None, alias="envVars", max_length=256)
    auto_pause: bool | None = Field(default=None, alias="autoPause")
    auto_resume: Any = Field(default=None, alias="autoResume")
    volume_mounts: list[Any] | None = Field(default=None, alias="volumeMounts")
    network: dict[str, Any] | None = None
    allow_internet_access: bool | None = Field(default=None, alias="allow_internet_access")


class NetworkUpdate(E2BRequest):
    """`PUT /sandboxes/{id}/network` (SDK 2.63's `update_network`): the running sandbox's egress configuration,
    whole: what it leaves out is cleared (E2B's semantics), so an empty body gives back the template's allowlist.
    Options with no equivalent are refused by name (frontdoor/mapping.network_update), unknown ones too."""

    model_config = ConfigDict(extra="allow", frozen=True, populate_by_name=True)

    allow_out: list[Any] | None = Field(default=None, alias="allowOut")
    deny_out: list[Any] | None = Field(default=None, alias="denyOut")
    dns_servers: list[Any] | None = Field(default=None, alias="dnsServers")
    egress_proxy: Any = Field(default=None, alias="egressProxy")
    rules: dict[str, Any] | None = None
    allow_internet_access: bool | None = Field(default=None, alias="allow_internet_access")
    allow_public_traffic: bool | None = Field(default=None, alias="allowPublicTraffic")


class ConnectBody(E2BRequest):
    timeout: int | None = Field(default=None, ge=1, le=30 * 86400)


class TimeoutBody(E2BRequest):
    timeout: int = Field(ge=0, le=30 * 86400)


class E2BReply(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    def body(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class Error(E2BReply):
    """Every error: the SDK reads `message` (a text body would crash its parser)."""

    code: int
    message: str


class SandboxCreated(E2BReply):
    """create and connect."""

    template_id: str = Field(alias="templateID")
    sandbox_id: str = Field(alias="sandboxID")
    client_id: str = Field(alias="clientID")
    envd_version: str = Field(alias="envdVersion")
    alias: str | None = None
    envd_access_token: str | None = Field(default=None, alias="envdAccessToken")
    traffic_access_token: str | None = Field(default=None, alias="trafficAccessToken")
    domain: str | None = None


class ListedSandbox(E2BReply):
    template_id: str = Field(alias="templateID")
    sandbox_id: str = Field(alias="sandboxID")
    client_id: str = Field(alias="clientID")
    alias: str | None = None
    started_at: str = Field(alias="startedAt")  # ISO 8601
    end_at: str = Field(alias="endAt")
    cpu_count: int = Field(alias="cpuCount")
    memory_mb: int = Field(alias="memoryMB")
    disk_size_mb: int = Field(alias="diskSizeMB")
    state: str  # running | paused (we have no paused)
    envd_version: str = Field(alias="envdVersion")
    metadata: dict[str, str] = Field(default_factory=dict)


class SandboxWorkload(E2BReply):
    """A running sandbox whose workload service stopped answering (its calls fail with `reason`): E2B has no
    such state, so `state` stays `running` for the SDK and this extra property, which the SDK keeps among a
    reply's additional properties, says it."""

    state: Literal["unresponsive"]
    reason: str | None = None  # a catalog code, e.g. workload.unresponsive
    since: str  # ISO 8601
    message: str | None = None


class SandboxDetail(ListedSandbox):
    """get_info: a listed sandbox plus its access token and domain, and `workload` while it does not answer."""

    envd_access_token: str | None = Field(default=None, alias="envdAccessToken")
    domain: str | None = None
    workload: SandboxWorkload | None = None


# ---- GET /sandboxes/{id}/metrics ---------------------------------------------------------------------------------


class GuestRecord(BaseModel):
    """What the guest's workload service writes (stdlib there, so it writes this shape by hand: envd's
    `/metrics` sample fields); unknown fields are ignored so a newer guest still parses."""

    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)


class GuestSample(GuestRecord):
    ts: int
    cpu_count: int = Field(ge=0)
    cpu_used_pct: float
    mem_total: int = Field(ge=0)
    mem_used: int = Field(ge=0)
    mem_cache: int = Field(default=0, ge=0)
    disk_used: int = Field(ge=0)
    disk_total: int = Field(ge=0)


# Not protocol/reports.GuestPciDevice (cube-agent's report, `vendor_id` without 0x): this is the workload
# service's metrics entry, the host's reading of protocol/guest_metrics.PciFunction.
class GuestPciDevice(GuestRecord):
    address: str
    vendor: str  # "0x10de"
    device: str
    pci_class: str = Field(alias="class")
    driver: str  # "" when no driver is bound


class GuestMetrics(GuestRecord):
    """`GET /cubeaccel/metrics` of the workload service: its samples (every 5 s, the last hour) and the PCI
    functions it sees."""

    samples: list[GuestSample] = Field(max_length=10_000)
    devices: list[GuestPciDevice] = Field(max_length=1024)


class MetricDevice(E2BReply):
    """One of the sandbox's devices now: the node's state for it and what the guest sees of it."""

    id: str
    state: str
    accel_class: str = Field(alias="class")
    guest: list[GuestPciDevice]  # the guest's PCI functions with this device's vendor and device ids


class SandboxMetric(E2BReply):
    """E2B's SandboxMetric; the newest one also carries `devices` (an extension the SDK ignores)."""

    timestamp: str
    timestamp_unix: int = Field(alias="timestampUnix")
    cpu_count: int = Field(alias="cpuCount")
    cpu_used_pct: float = Field(alias="cpuUsedPct")
    mem_used: int = Field(alias="memUsed")
    mem_total: int = Field(alias="memTotal")
    mem_cache: int = Field(alias="memCache")
    disk_used: int = Field(alias="diskUsed")
    disk_total: int = Field(alias="diskTotal")
    devices: list[MetricDevice] | None = None
