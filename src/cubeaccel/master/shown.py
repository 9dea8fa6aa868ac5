"""The state a reply shows for a sandbox, which is the stored one except on a silent node (issue 30 #8)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Literal

from cubeaccel.model.sandbox_states import UNKNOWN_STATE, SandboxState

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
