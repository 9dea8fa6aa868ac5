"""CubeMaster's store applies sandbox state changes through the table (real SQLite): random event sequences
against a model, an illegal request refused whatever the row's state, and `state=` no longer accepted."""

from __future__ import annotations

import itertools
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cubeaccel.master.store import MasterStore
from cubeaccel.model.machine import TransitionRefused
from cubeaccel.model.sandbox_states import (
    NODE_MACHINE,
    SANDBOX_MACHINE,
    NodeEvent,
    NodeState,
    SandboxActor,
    SandboxEvent,
    SandboxState,
)
from tests.support.master_builders import group, heartbeat
from tests.unit.test_scheduler_store import sandbox

SS, SE, SA = SandboxState, SandboxEvent, SandboxActor
_ids = itertools.count()


@pytest.fixture(scope="module")
def shared() -> Iterator[MasterStore]:
    with tempfile.TemporaryDirectory() as d:
        s = MasterStore(str(Path(d) / "m.db"))
        yield s
        s.close()


# (event, actor, expect): expect narrows the guard to states the table allows that actor to fire from.
step = st.sampled_from(list(SandboxEvent)).flatmap(
    lambda ev: st.sampled_from(list(SandboxActor)).flatmap(
        lambda by: st.tuples(
            st.just(ev),
            st.just(by),
            st.none() | st.sets(st.sampled_from(sorted(SANDBOX_MACHINE.sources(ev, by))), min_size=1).map(tuple)
            if SANDBOX_MACHINE.sources(ev, by)
            else st.none(),
        )
    )
)


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(step, max_size=12))
def test_the_stored_state_follows_the_table_for_any_event_sequence(
    shared: MasterStore, steps: list[tuple[SandboxEvent, SandboxActor, tuple[SandboxState, ...] | None]]
) -> None:
    sid = f"hyp-{next(_ids)}"
    assert shared.insert_sandbox(sandbox(sid)) is None
    model, phases = SS.SCHEDULING, []
    for i, (event, by, expect) in enumerate(steps):
        guard = SANDBOX_MACHINE.sources(event, by) & (set(expect) if expect else set(SandboxState))
        applied = shared.update_sandbox(sid, f"step{i}", expect=expect, event=event, by=by)
        assert applied is (model in guard)
        if applied:
            model = SANDBOX_MACHINE.transition(model, event, by)
            phases.append(f"step{i}")
        row = shared.sandbox(sid)
        assert row is not None and row.state is model
        assert [t.phase for t in row.timeline] == phases  # a refused step leaves no trace


def test_an_expect_outside_the_table_is_refused_whatever_the_row_is_in(shared: MasterStore) -> None:
    sid = f"illegal-{next(_ids)}"
    shared.insert_sandbox(sandbox(sid))
    with pytest.raises(TransitionRefused) as err:  # the row is `scheduling`; the call asks for deleted → running
        shared.update_sandbox(sid, "ready", expect=(SS.DELETED,), event=SE.READY, by=SA.CUBELET)
    assert err.value.code == "sandbox.transition_refused" and err.value.details["state"] == "deleted"
    with pytest.raises(TransitionRefused) as err:  # a user may not mark a placing sandbox running
        shared.update_sandbox(sid, "ready", expect=(SS.PLACING,), event=SE.READY, by=SA.USER)
    assert err.value.code == "sandbox.actor_not_allowed"
    row = shared.sandbox(sid)
    assert row is not None and row.state is SS.SCHEDULING and row.timeline == ()


def test_a_state_can_no_longer_be_written_as_a_column(shared: MasterStore) -> None:
    sid = f"column-{next(_ids)}"
    shared.insert_sandbox(sandbox(sid))
    with pytest.raises(TypeError, match="event="):
        shared.update_sandbox(sid, "reserved", state="running")
    with pytest.raises(TypeError, match="by="):
        shared.update_sandbox(sid, "reserved", event=SE.READY)
    assert shared.sandbox(sid).state is SS.SCHEDULING  # type: ignore[union-attr]


def test_claim_moves_scheduling_to_placing_once(shared: MasterStore) -> None:
    node = f"n-{next(_ids)}"
    shared.heartbeat(heartbeat(node, group("H100-PCIe-80GB", 4)), time.time(), 10)
    key = next(v for v in shared.all_node_views() if v.name == node).groups[0].key
    sid = f"claim-{next(_ids)}"
    shared.insert_sandbox(sandbox(sid))
    assert shared.admit(sid, node, key, 1, time.time(), 10)
    assert not shared.admit(sid, node, key, 1, time.time(), 10)  # placing is no source of a claim
    assert shared.sandbox(sid).state is SS.PLACING  # type: ignore[union-attr]


def test_node_drain_and_undrain_go_through_the_node_table(shared: MasterStore) -> None:
    node = f"n-{next(_ids)}"
    shared.heartbeat(heartbeat(node, group("H100-PCIe-80GB", 1)), time.time(), 10)
    assert shared.node_event(node, NodeEvent.DRAIN) is NodeState.DRAINING
    assert shared.node_event(node, NodeEvent.DRAIN) is NodeState.DRAINING  # idempotent, as the verb always was
    views = {v.name: v for v in shared.all_node_views()}
    assert views[node].state == NodeState.DRAINING
    assert shared.node_event(node, NodeEvent.UNDRAIN) is NodeState.READY
    assert NODE_MACHINE.allowed_events(NodeState.READY) == [NodeEvent.DRAIN, NodeEvent.UNDRAIN]
