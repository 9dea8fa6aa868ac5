"""The state a reply shows for a sandbox, which is the stored one except on a silent node; and its workload
condition, read from its timeline."""

from __future__ import annotations

from collections.abc import Collection
from typing import Literal

from cubeaccel.model.sandbox_states import UNKNOWN_STATE, SandboxState
from cubeaccel.wire.master_api import TimelineEntry, WorkloadCondition
from cubeaccel.wire.sandbox_timeline import WORKLOAD_RECOVERED, WORKLOAD_UNRESPONSIVE, WorkloadChanged

SS = SandboxState
LIVE_STATES: tuple[SandboxState, ...] = (SS.STARTING, SS.RUNNING)  # a node's word about it can end it
# Shown, never stored, for a live sandbox on a node whose heartbeats are stale (staleness is derived, like the
# node's): nobody knows whether it still runs, and the node may come back with it.
UNKNOWN = UNKNOWN_STATE


def shown_state(
    state: SandboxState, node: str | None, silent_nodes: Collection[str]
) -> tuple[SandboxState | Literal["unknown"], SandboxState | None]:
    """(the state a reply shows, the stored state when the reply shows another)."""
    if node is not None and node in silent_nodes and state in LIVE_STATES:
        return "unknown", state
    return state, None


def workload_condition(state: SandboxState, timeline: Collection[TimelineEntry]) -> WorkloadCondition | None:
    """`unresponsive` when the last workload entry of a live sandbox's timeline says its service stopped
    answering; None once it recovered, before anything was said, or when the sandbox is no longer live (the
    entries stay as history)."""
    if state not in LIVE_STATES:
        return None
    last = next((t for t in reversed(list(timeline)) if t.phase in (WORKLOAD_UNRESPONSIVE, WORKLOAD_RECOVERED)), None)
    if last is None or last.phase != WORKLOAD_UNRESPONSIVE:
        return None
    said = WorkloadChanged.model_validate(last.model_extra or {})
    return WorkloadCondition(state="unresponsive", reason=said.reason, since=said.since, message=said.message)
