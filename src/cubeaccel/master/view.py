"""CubeMaster's picture of a node, built from its latest heartbeat: summaries only, never device state.

A `NodeView` is immutable apart from two memo dicts; a new heartbeat makes a new view. What was admitted
(placements this cluster made that the node's last summary cannot show yet; `claimed` in the API's JSON, a public
name kept) is kept beside it, so "free" is always derived: summary allocatable minus admitted, never a counter kept
in sync.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit

from pydantic import ValidationError

from cubeaccel.model.contract import ContractViolation
from cubeaccel.model.node_facts import GuestImageFact
from cubeaccel.model.pinned_memory import sandbox_locked_mib
from cubeaccel.model.profiles import PROFILES
from cubeaccel.model.sandbox_states import NodeState
from cubeaccel.protocol.errors import CubeError
from cubeaccel.wire import master_api as W
from cubeaccel.wire.capacity import CapacityGroup
from cubeaccel.wire.cubelet_api import HostProblem
from cubeaccel.wire.heartbeat import Heartbeat
from cubeaccel.wire.warm import WarmPoolFact

SummaryT = TypeVar("SummaryT", bound=W.NodeSummary)

# model label → (vendor_id, device_id), for summaries whose group labels omit the ids
_IDS_BY_MODEL = {p.model: (f"{v:04x}", f"{d:04x}") for (v, d), p in PROFILES.items()}


@dataclass(frozen=True)
class Group:
    """One capacity group: devices of one class with equal summary labels on one node."""

    key: str
    accel_class: str
    labels: Mapping[str, str]  # summary labels (the reservation's equality constraints)
    attributes: Mapping[str, str]  # labels + class + ids: what selectors and the contract see
    total: int
    allocatable: int
    by_numa: Mapping[str, int]
    returning: int = 0  # being released or scrubbed: allocatable again soon unless the node quarantines them


@dataclass
class NodeView:
    name: str
    cubelet_url: str
    state: str  # a NodeState (operator verb); staleness is derived from received_at
    received_at: float  # master clock
    sent_at: float  # Cubelet clock (compared with Cubelet-clock reservation times only)
    version: str
    backends: frozenset[str]
    pinnable_memory_mib: int
    guest_images: tuple[GuestImageFact, ...]  # what the node can boot; empty: nothing (every template refused)
    hotplug: frozenset[str]  # hot-plug paths of the node's VMM; empty: hot-plug templates refused
    groups: tuple[Group, ...]
    admitted: dict[str, int] = field(default_factory=dict)  # group key → devices admitted, not yet in summary
    contract_memo: dict[str, list[ContractViolation]] = field(default_factory=dict)
    device_memo: dict[tuple[str, str], bool] = field(default_factory=dict)
    # Host readiness as the Cubelet last checked it (`ready`, `host_problems`); absent in a heartbeat: ready.
    host_ready: bool = True
    host_problems: tuple[tuple[str, str], ...] = ()  # (code, message)
    pinned: Mapping[str, Any] = field(default_factory=dict)  # the heartbeat's `pinned_memory` ledger, as sent
    admitted_memory_mib: int = 0  # MiB to be locked by placements the last heartbeat cannot show yet
    max_devices: int | None = None  # per sandbox, as the Cubelet advertised it; None: an older Cubelet, not said
    warm_pools: tuple[WarmPoolFact, ...] = ()  # docs/warm.md: shape, counts, the ids ready to claim
    warm_claimed: frozenset[str] = frozenset()  # warm ids this cluster's claim rows hold (not offered again)
    warm_draining: bool | None = None  # the Cubelet's warm drain as its last heartbeat said; None: not said
    reserve_waits: bool = False  # its reserve waits for devices coming back when asked (`capacity_wait_s`)
    summary_digest: str | None = None  # the stored summary's digest (master/store.py); None: not from a row

    def free(self, g: Group) -> int:
        return g.allocatable - self.admitted.get(g.key, 0)

    def free_pinnable_mib(self) -> int:
        """Free lockable memory: the heartbeat's, minus what this cluster placed since (as `free` for devices)."""
        return max(0, self.pinnable_memory_mib - self.admitted_memory_mib)

    def locked_mib(self, memory_mib: int, vcpus: int, pin_memory: bool) -> int:
        """What a sandbox would take from this node's lockable memory, with the node's own VMM overhead."""
        return sandbox_locked_mib(
            memory_mib,
            vcpus,
            pin_memory,
            _int(self.pinned.get("vmm_overhead_mib")),
            _int(self.pinned.get("vmm_overhead_per_vcpu_mib")),
        )

    def warm_free(self, pool: WarmPoolFact) -> list[str]:
        """The pool's warm ids no claim row holds: what a matching create may still take here."""
        return [w.id for w in pool.sandboxes if w.id not in self.warm_claimed]

    def warm_shown(self) -> list[W.WarmPoolShown]:
        return [
            W.WarmPoolShown(
                key=p.key,
                template=p.template,
                accel_class=p.accel_class,
                count=p.count,
                memory_mib=p.memory_mib,
                vcpus=p.vcpus,
                size=p.size,
                warm=p.warm,
                starting=p.starting,
                claimable=len(self.warm_free(p)),
                sandboxes=[w.id for w in p.sandboxes],
            )
            for p in self.warm_pools
        ]

    def stale(self, now: float, staleness_s: float) -> bool:
        return now - self.received_at > staleness_s

    def summary(self, now: float, staleness_s: float, model: type[SummaryT]) -> SummaryT:
        """What CubeMaster shows of the node (`model`: `NodeSummary`, or `NodeReply` for one node)."""
        stale = self.stale(now, staleness_s)
        return model(
            node=self.name,
            cubelet_url=self.cubelet_url,
            version=self.version,
            state="stale" if stale else NodeState(self.state),
            schedulable=self.state == NodeState.READY and self.host_ready and not stale,
            ready=self.host_ready,
            host_problems=[HostProblem(code=c, message=m) for c, m in self.host_problems],
            pinned_memory=W.PinnedMemoryShown.model_validate(
                {
                    **self.pinned,
                    "claimed_mib": self.admitted_memory_mib,
                    "free_after_claims_mib": self.free_pinnable_mib(),
                }
            ),
            last_heartbeat_age_s=round(now - self.received_at, 3),
            backends=sorted(self.backends),
            pinnable_memory_mib=self.pinnable_memory_mib,
            guest_images=[W.GuestImage.model_validate(i.to_json()) for i in self.guest_images],
            hotplug=sorted(self.hotplug),
            max_devices_per_sandbox=self.max_devices,
            warm=sum(p.warm for p in self.warm_pools),
            warm_pools=self.warm_shown(),
            total=sum(g.total for g in self.groups),
            allocatable=sum(max(0, self.free(g)) for g in self.groups),
            groups=[
                W.NodeGroup(
                    accel_class=g.accel_class,
                    labels=dict(g.labels),
                    total=g.total,
                    allocatable=max(0, self.free(g)),
                    claimed=self.admitted.get(g.key, 0),
                    allocatable_by_numa=dict(g.by_numa),
                )
                for g in self.groups
            ],
        )


def _int(raw: Any) -> int:
    return int(raw) if isinstance(raw, int) and not isinstance(raw, bool) else 0


def group_key(accel_class: str, labels: Mapping[str, str]) -> str:
    return accel_class + "|" + json.dumps(dict(sorted(labels.items())), separators=(",", ":"))


def device_attributes(accel_class: str, labels: Mapping[str, str]) -> dict[str, str]:
    """What selectors and the contract see of a device with these summary labels."""
    return _attributes(accel_class, labels)


def _attributes(accel_class: str, labels: Mapping[str, str]) -> dict[str, str]:
    attrs = {**labels, "class": accel_class}
    if "vendor_id" not in attrs or "device_id" not in attrs:
        ids = _IDS_BY_MODEL.get(attrs.get("model", ""))
        if ids is None and ":" in attrs.get("model", ""):  # unknown devices are labelled "vvvv:dddd"
            vid, _, did = attrs["model"].partition(":")
            ids = (vid, did)
        if ids is not None:
            attrs.setdefault("vendor_id", ids[0])
            attrs.setdefault("device_id", ids[1])
    return attrs


def cubelet_url(raw: Any) -> str:
    """`http(s)://host:port` and nothing else: CubeMaster sends requests there, so no other scheme or path."""
    try:
        u = urlsplit(raw) if isinstance(raw, str) else None
        port = u.port if u is not None else None
    except ValueError:
        u, port = None, None
    if (
        u is None
        or u.scheme not in ("http", "https")
        or not u.hostname
        or not port  # absent, or 0: no Cubelet can be reached there
        or "@" in u.netloc  # credentials, or an empty userinfo that would make one node two URLs
        or u.path not in ("", "/")
        or u.query
        or u.fragment
    ):
        raise CubeError("node.invalid_url", f"cubelet_url must be http(s)://HOST:PORT, got {raw!r}", "api")
    return f"{u.scheme}://{u.netloc}"


def _group(g: CapacityGroup) -> Group:
    return Group(
        group_key(g.accel_class, g.labels),
        g.accel_class,
        g.labels,
        _attributes(g.accel_class, g.labels),
        g.total,
        g.by_state.get("allocatable", 0),
        g.allocatable_by_numa,
        g.by_state.get("releasing", 0) + g.by_state.get("released", 0),
    )


def view_from_heartbeat(body: Mapping[str, Any], received_at: float, state: str = NodeState.READY) -> NodeView:
    """Validate a heartbeat body (`wire.heartbeat.Heartbeat`) into a view; malformed bodies are 422s."""
    url = cubelet_url(body.get("cubelet_url"))
    try:
        hb = Heartbeat.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise CubeError(
            "node.invalid_heartbeat",
            f"malformed heartbeat: {where}: {first['msg']}"
            + (f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""),
            "api",
        ) from e
    return NodeView(
        name=hb.node,
        cubelet_url=url,
        state=state,
        received_at=received_at,
        sent_at=received_at if hb.sent_at is None else hb.sent_at,
        version=hb.version,
        backends=frozenset(hb.capacity.backends),
        pinnable_memory_mib=hb.pinnable_memory_mib,
        guest_images=hb.images(),
        hotplug=hb.hotplug_paths(),
        groups=tuple(_group(g) for g in hb.capacity.groups),
        host_ready=hb.ready,
        host_problems=tuple((p.code, p.message) for p in hb.host_problems),
        pinned=hb.pinned_memory,
        max_devices=hb.max_devices_per_sandbox,
        warm_pools=tuple(hb.warm_pools),
        warm_draining=hb.warm_draining,
        reserve_waits=hb.reserve_waits,
    )
