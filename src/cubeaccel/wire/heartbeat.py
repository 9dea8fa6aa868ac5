"""Cubelet → CubeMaster heartbeat (`PUT /v1/nodes/{node}`): the capacity summary plus what the node can boot.

CubeMaster stores the body as sent and parses it again on every read, so this model reads every heartbeat an
older Cubelet wrote: fields added since (readiness, pinned memory, guest images, hot-plug paths, the
per-sandbox device limit, warm pools) have the defaults an older Cubelet meant, and unknown fields are ignored.
`version` is the Cubelet's package version; the message's own version is `v`.

`incarnation` is new each time a Cubelet process starts, and `ended` lists the sandboxes that process ended on its
own (its reconcile found the VMM gone, a guest failed): CubeMaster marks those at once and reconciles a node whose
incarnation changed, so a restart inside the staleness bound is not a blind spot (issue 30 #8).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Field, StrictBool, StrictStr, field_validator

from cubeaccel.model.node_facts import GuestImageFact, parse_guest_images, parse_hotplug
from cubeaccel.wire.base import Count, Finite, Lenient, LenientMessage, count
from cubeaccel.wire.capacity import CapacitySummary
from cubeaccel.wire.master_api import PinnedLedger, StatusError
from cubeaccel.wire.warm import WarmPoolFact

PINNED_COUNTS = ("lockable_mib", "locked_mib", "free_mib", "vmm_overhead_mib", "vmm_overhead_per_vcpu_mib")


def _none_is_empty(raw: Any) -> Any:
    return [] if raw is None else raw


# Not wire/cubelet_api.HostProblem: CubeMaster parses stored heartbeats again on every read, so this one is lenient
# (texts coerced, message optional) and reads what an older Cubelet wrote.
class HostProblem(Lenient):
    code: Annotated[str, BeforeValidator(str)]
    message: Annotated[str, BeforeValidator(str)] = ""


class EndedSandbox(Lenient):
    """A sandbox the node ended on its own, with the failure it recorded."""

    sandbox_id: StrictStr = Field(min_length=1, max_length=256)
    created_at: Finite  # the reservation's: a later sandbox reusing the id is not this one
    error: StatusError


MAX_ENDED = 1024


class NodeNews(Lenient):
    """The heartbeat's word on the node's sandboxes; CubeMaster reads it on its own (the rest is stored)."""

    incarnation: StrictStr | None = Field(default=None, max_length=64)  # None: a Cubelet older than the field
    ended: Annotated[list[EndedSandbox], BeforeValidator(_none_is_empty), Field(max_length=MAX_ENDED)] = []


class Heartbeat(LenientMessage, NodeNews):
    node: StrictStr
    cubelet_url: StrictStr  # checked by CubeMaster (`node.invalid_url`) before the rest
    version: Annotated[str, BeforeValidator(str)] = ""
    capacity: CapacitySummary
    pinnable_memory_mib: Count = 0  # free lockable memory: what a new sandbox may lock
    pinned_memory: dict[str, Any] = {}  # the ledger (cubelet/memory_ledger.py) as sent, checked as `PinnedLedger`
    ready: StrictBool = True
    host_problems: Annotated[list[HostProblem], BeforeValidator(_none_is_empty)] = []
    guest_images: list[dict[str, Any]] | None = None  # newest first; checked by model.node_facts
    hotplug: list[Any] | None = None
    # The most devices one sandbox may hold on this node (its VMM's hot-plug slots). None: a Cubelet older than
    # the field, which never said; CubeMaster does not filter on it and that Cubelet's `reserve` decides, as before.
    max_devices_per_sandbox: Count | None = None
    # The node's warm pools (docs/warm.md): shape, counts and the ids ready to claim. Absent (an older Cubelet):
    # none, so every create there takes the cold path.
    warm_pools: Annotated[list[WarmPoolFact], BeforeValidator(_none_is_empty)] = []
    # Whether the node's warm pools are drained (a node drain, `down`). None: a Cubelet older than the field.
    warm_draining: StrictBool | None = None
    # Whether this Cubelet's reserve takes `capacity_wait_s` (waits on the node for devices coming back). False:
    # a Cubelet older than the field, which would refuse the field; CubeMaster waits on its heartbeats instead.
    reserve_waits: StrictBool = False
    sent_at: Finite | None = None  # Cubelet clock, read before the capacity: the summary is at least this fresh

    @field_validator("pinned_memory", mode="before")
    @classmethod
    def _pinned_counts(cls, raw: Any) -> Any:
        raw = raw or {}
        if isinstance(raw, dict):
            raw = {k: count(v) if k in PINNED_COUNTS else v for k, v in raw.items()}
            PinnedLedger.model_validate(raw)  # what CubeMaster serves of it: refused here, not on every node list
        return raw

    @field_validator("guest_images", mode="after")
    @classmethod
    def _images(cls, raw: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        parse_guest_images(raw)  # a ValueError names what is wrong
        return raw

    @field_validator("hotplug", mode="after")
    @classmethod
    def _hotplug(cls, raw: list[Any] | None) -> list[Any] | None:
        parse_hotplug(raw)
        return raw

    def images(self) -> tuple[GuestImageFact, ...]:
        return parse_guest_images(self.guest_images)

    def hotplug_paths(self) -> frozenset[str]:
        return parse_hotplug(self.hotplug)

    def to_json(self) -> dict[str, object]:
        return self.model_dump(mode="json", by_alias=True)
