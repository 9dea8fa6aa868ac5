"""CubeMaster reads a sandbox's workload condition from its timeline: the last workload entry of a live sandbox
decides, other entries between them do not, and an ended sandbox shows none (the entries stay as history)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cubeaccel.master.shown import LIVE_STATES, workload_condition
from cubeaccel.model.sandbox_states import SandboxState
from cubeaccel.wire.master_api import TimelineEntry

PHASES = ["workload_unresponsive", "workload_recovered", "ready", "network_set"]


def _entry(i: int, phase: str) -> TimelineEntry:
    detail = {"since": float(i), "reason": "workload.unresponsive"} if phase.startswith("workload_") else {}
    return TimelineEntry.model_validate({"at": float(i), "phase": phase, **detail})


@given(phases=st.lists(st.sampled_from(PHASES), max_size=12), state=st.sampled_from(list(SandboxState)))
def test_the_last_workload_entry_of_a_live_sandbox_decides(phases: list[str], state: SandboxState) -> None:
    timeline = [_entry(i, p) for i, p in enumerate(phases)]
    said = [(i, p) for i, p in enumerate(phases) if p.startswith("workload_")]
    shown = workload_condition(state, timeline)
    if state in LIVE_STATES and said and said[-1][1] == "workload_unresponsive":
        assert shown is not None
        assert (shown.state, shown.reason, shown.since) == ("unresponsive", "workload.unresponsive", said[-1][0])
    else:
        assert shown is None
