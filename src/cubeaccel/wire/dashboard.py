"""The dashboard's data: what a Cubelet tells CubeMaster for it (`GET /v1/dashboard`), and what CubeMaster serves
its page (`GET /v1/dashboard`, admins). Read-only views; unknown fields pass through (`Record`)."""

from __future__ import annotations

from typing import Any

from cubeaccel.model.reservation_states import ReservationPhase
from cubeaccel.wire.base import Record, Reply
from cubeaccel.wire.cubelet_api import Device, JournalEvent


class DashboardEvent(JournalEvent):
    """A journal event as the page lists it: without its details."""


class DashboardSandbox(Record):
    sandbox_id: str
    phase: ReservationPhase  # the reservation's phase on the node
    device_ids: list[str]
    created_at: float
    phases: dict[str, float]  # cold-start waterfall (model.cold_start.PHASES), empty until running
    start: dict[str, str | None] = {}  # {"path": template|cold, "reason": why cold}, empty until the VM started


class NodeDashboard(Reply):
    node: str
    devices: list[Device]
    sandboxes: list[DashboardSandbox]
    events: list[DashboardEvent]  # newest first


class DashboardNode(Record):
    node: str
    state: str  # ready, draining, stale, …
    schedulable: bool
    error: dict[str, Any] | None = None  # the node could not be asked (its last known summary is still shown)
    devices: list[dict[str, Any]] = []
    sandboxes: list[DashboardSandbox] = []
    warm_pools: list[dict[str, Any]] = []  # from the heartbeat: per pool size, warm, starting, claimable


class Dashboard(Reply):
    at: float
    nodes: list[DashboardNode]
    sandboxes: list[dict[str, Any]]  # CubeMaster's records, with the node's waterfall; then the warm ones
    events: list[dict[str, Any]]  # newest first, every node merged, with `node`
