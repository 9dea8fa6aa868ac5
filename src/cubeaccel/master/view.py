"""CubeMaster's picture of a node, built from its latest heartbeat: summaries only, never device state.

A `NodeView` is immutable apart from two memo dicts; a new heartbeat makes a new view. Pending claims
(placements this cluster made that the node's last summary cannot show yet) are kept beside it, so
"free" is always derived: summary allocatable minus claims, never a counter kept in sync.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from cubeaccel.model.contract import ContractViolation
from cubeaccel.model.errors import CubeError
from cubeaccel.model.node_facts import GuestImageFact, parse_guest_images, parse_hotplug
from cubeaccel.model.pinned_memory import sandbox_locked_mib
from cubeaccel.model.profiles import PROFILES
from cubeaccel.model.sandbox_states import NodeState

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
    claims: dict[str, int] = field(default_factory=dict)  # group key → devices claimed, not yet in summary
    contract_memo: dict[str, list[ContractViolation]] = field(default_factory=dict)
    device_memo: dict[tuple[str, str], bool] = field(default_factory=dict)
    # Host readiness as the Cubelet last checked it (`ready`, `host_problems`); absent in a heartbeat: ready.
    host_ready: bool = True
    host_problems: tuple[tuple[str, str], ...] = ()  # (code, message)
    pinned: Mapping[str, Any] = field(default_factory=dict)  # the heartbeat's `pinned_memory` ledger, as sent
    memory_claims_mib: int = 0  # MiB to be locked by placements the last heartbeat cannot show yet

    def free(self, g: Group) -> int:
        return g.allocatable - self.claims.get(g.key, 0)

    def free_pinnable_mib(self) -> int:
        """Free lockable memory: the heartbeat's, minus what this cluster placed since (as `free` for devices)."""
        return max(0, self.pinnable_memory_mib - self.memory_claims_mib)

    def locked_mib(self, memory_mib: int, vcpus: int, pin_memory: bool) -> int:
        """What a sandbox would take from this node's lockable memory, with the node's own VMM overhead."""
        return sandbox_locked_mib(
            memory_mib,
            vcpus,
            pin_memory,
            _int(self.pinned.get("vmm_overhead_mib")),
            _int(self.pinned.get("vmm_overhead_per_vcpu_mib")),
        )

    def stale(self, now: float, staleness_s: float) -> bool:
        return now - self.received_at > staleness_s

    def summary_json(self, now: float, staleness_s: float) -> dict[str, Any]:
        return {
            "node": self.name,
            "cubelet_url": self.cubelet_url,
            "version": self.version,
            "state": "stale" if self.stale(now, staleness_s) else self.state,
            "schedulable": self.state == NodeState.READY and self.host_ready and not self.stale(now, staleness_s),
            "ready": self.host_ready,
            "host_problems": [{"code": c, "message": m} for c, m in self.host_problems],
            "pinned_memory": {
                **self.pinned,
                "claimed_mib": self.memory_claims_mib,
                "free_after_claims_mib": self.free_pinnable_mib(),
            },
            "last_heartbeat_age_s": round(now - self.received_at, 3),
            "backends": sorted(self.backends),
            "pinnable_memory_mib": self.pinnable_memory_mib,
            "guest_images": [i.to_json() for i in self.guest_images],
            "hotplug": sorted(self.hotplug),
            "total": sum(g.total for g in self.groups),
            "allocatable": sum(max(0, self.free(g)) for g in self.groups),
            "groups": [
                {
                    "class": g.accel_class,
                    "labels": dict(g.labels),
                    "total": g.total,
                    "allocatable": max(0, self.free(g)),
                    "claimed": self.claims.get(g.key, 0),
                    "allocatable_by_numa": dict(g.by_numa),
                }
                for g in self.groups
            ],
        }


def _int(raw: Any) -> int:
    return int(raw) if isinstance(raw, int) and not isinstance(raw, bool) else 0


def group_key(accel_class: str, labels: Mapping[str, str]) -> str:
    return accel_class + "|" + json.dumps(dict(sorted(labels.items())), separators=(",", ":"))


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


def _number(raw: Any, what: str) -> float:
    """A finite JSON number: `"nan"`, NaN/Infinity literals and 1e400 would reach the database or the math."""
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not math.isfinite(raw):
        raise ValueError(f"{what} must be a finite number, got {raw!r}")
    return float(raw)


def _count(raw: Any, what: str) -> int:
    """A whole number in 0..2^53 (device counts, MiB): what a JSON number carries exactly."""
    value = _number(raw, what)
    if not 0 <= value <= 2**53 or value != int(value):
        raise ValueError(f"{what} must be an integer in 0..2^53, got {raw!r}")
    return int(value)


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
        or port is None
        or u.username
        or u.password
        or u.path not in ("", "/")
        or u.query
        or u.fragment
    ):
        raise CubeError("node.invalid_url", f"cubelet_url must be http(s)://HOST:PORT, got {raw!r}", "api", {}, 422)
    return f"{u.scheme}://{u.netloc}"


def _group(raw: Any) -> Group:
    if not isinstance(raw, Mapping):
        raise ValueError("group is not an object")
    cls, labels = str(raw["class"]), {str(k): str(v) for k, v in dict(raw["labels"]).items()}
    by_state = dict(raw.get("by_state", {}))
    numa = {str(k): _count(v, "allocatable_by_numa") for k, v in dict(raw.get("allocatable_by_numa", {})).items()}
    return Group(
        group_key(cls, labels),
        cls,
        labels,
        _attributes(cls, labels),
        _count(raw["total"], "total"),
        _count(by_state.get("allocatable", 0), "by_state.allocatable"),
        numa,
    )


def _host_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    """Host readiness and the pinned-memory ledger; an older Cubelet sends neither (ready, no VMM overhead)."""
    ready = body.get("ready", True)
    if not isinstance(ready, bool):
        raise ValueError(f"ready must be a boolean, got {ready!r}")
    problems = tuple((str(p["code"]), str(p.get("message", ""))) for p in body.get("host_problems") or [])
    pinned = dict(body.get("pinned_memory") or {})
    for k in ("lockable_mib", "locked_mib", "free_mib", "vmm_overhead_mib", "vmm_overhead_per_vcpu_mib"):
        if k in pinned:
            pinned[k] = _count(pinned[k], f"pinned_memory.{k}")
    return {"host_ready": ready, "host_problems": problems, "pinned": pinned}


def view_from_heartbeat(body: Mapping[str, Any], received_at: float, state: str = NodeState.READY) -> NodeView:
    """Validate a heartbeat body (the agreed shape) into a view; malformed bodies are 422s."""
    url = cubelet_url(body.get("cubelet_url"))
    try:
        cap = body["capacity"]
        return NodeView(
            name=str(body["node"]),
            cubelet_url=url,
            state=state,
            received_at=received_at,
            sent_at=_number(body.get("sent_at", received_at), "sent_at"),
            version=str(body.get("version", "")),
            backends=frozenset(str(b) for b in cap.get("backends", [])),
            pinnable_memory_mib=_count(body.get("pinnable_memory_mib", 0), "pinnable_memory_mib"),
            guest_images=parse_guest_images(body.get("guest_images")),
            hotplug=parse_hotplug(body.get("hotplug")),
            groups=tuple(_group(g) for g in cap.get("groups", [])),
            **_host_fields(body),
        )
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
        raise CubeError(
            "node.invalid_heartbeat", f"malformed heartbeat: {type(e).__name__}: {e}", "api", {}, 422
        ) from e
