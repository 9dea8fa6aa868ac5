"""The reservation, sandbox and node tables are the spec: every (state, event) pair is checked against them,
the way `test_states.py` checks the device table. The expected tables are written out here independently."""

from __future__ import annotations

import itertools
from enum import StrEnum
from pathlib import Path

import pytest

from cubeaccel.cubelet.store import Reservation, Store
from cubeaccel.model.machine import Machine, TransitionRefused, rule
from cubeaccel.model.reservation_params import ReservationParams
from cubeaccel.model.reservation_states import (
    RESERVATION_MACHINE,
    ReservationEvent,
    ReservationPhase,
    next_phase,
)
from cubeaccel.model.sandbox_states import (
    NODE_MACHINE,
    SANDBOX_MACHINE,
    NodeEvent,
    NodeState,
    SandboxActor,
    SandboxEvent,
    SandboxState,
)
from cubeaccel.model.states import Actor

P, RE = ReservationPhase, ReservationEvent
SS, SE, SA = SandboxState, SandboxEvent, SandboxActor
N, NE = NodeState, NodeEvent

RESERVATION: dict[tuple[ReservationPhase, ReservationEvent], tuple[ReservationPhase, set[Actor]]] = {
    (P.RESERVED, RE.START): (P.STARTING, {Actor.CUBELET}),
    (P.STARTING, RE.READY): (P.RUNNING, {Actor.CUBELET}),
    (P.RESERVED, RE.TEARDOWN): (P.RELEASING, {Actor.CUBELET}),
    (P.STARTING, RE.TEARDOWN): (P.RELEASING, {Actor.CUBELET}),
    (P.RUNNING, RE.TEARDOWN): (P.RELEASING, {Actor.CUBELET}),
    (P.STARTING, RE.WARMED): (P.WARM, {Actor.CUBELET}),  # issue 28: a warm start joins the node's pool
    (P.WARM, RE.CLAIM): (P.RUNNING, {Actor.CUBELET}),
    (P.WARM, RE.TEARDOWN): (P.RELEASING, {Actor.CUBELET}),
}

SANDBOX: dict[tuple[SandboxState, SandboxEvent], tuple[SandboxState, set[SandboxActor]]] = {
    (SS.SCHEDULING, SE.CLAIM): (SS.PLACING, {SA.PLACEMENT}),
    (SS.PLACING, SE.REFUSED): (SS.SCHEDULING, {SA.PLACEMENT}),
    (SS.PLACING, SE.STARTED): (SS.STARTING, {SA.PLACEMENT}),
    (SS.PLACING, SE.READY): (SS.RUNNING, {SA.PLACEMENT, SA.MAINTENANCE}),
    (SS.STARTING, SE.READY): (SS.RUNNING, {SA.CUBELET}),
    (SS.SCHEDULING, SE.FAIL): (SS.FAILED, {SA.MAINTENANCE}),
    (SS.PLACING, SE.FAIL): (SS.FAILED, {SA.PLACEMENT, SA.CUBELET, SA.MAINTENANCE}),
    (SS.STARTING, SE.FAIL): (SS.FAILED, {SA.CUBELET, SA.MAINTENANCE}),
    (SS.RUNNING, SE.FAIL): (SS.FAILED, {SA.CUBELET, SA.MAINTENANCE}),
    (SS.STARTING, SE.LOSE): (SS.LOST, {SA.MAINTENANCE}),
    (SS.RUNNING, SE.LOSE): (SS.LOST, {SA.MAINTENANCE}),
    (SS.SCHEDULING, SE.DELETE): (SS.DELETING, {SA.USER}),
    (SS.PLACING, SE.DELETE): (SS.DELETING, {SA.USER}),
    (SS.STARTING, SE.DELETE): (SS.DELETING, {SA.USER}),
    (SS.RUNNING, SE.DELETE): (SS.DELETING, {SA.USER}),
    (SS.DELETING, SE.DELETE): (SS.DELETING, {SA.USER}),
    (SS.STARTING, SE.TIMEOUT): (SS.DELETING, {SA.MAINTENANCE}),
    (SS.RUNNING, SE.TIMEOUT): (SS.DELETING, {SA.MAINTENANCE}),
    (SS.STARTING, SE.REVOKED): (SS.DELETING, {SA.USER, SA.MAINTENANCE}),
    (SS.RUNNING, SE.REVOKED): (SS.DELETING, {SA.USER, SA.MAINTENANCE}),
    (SS.DELETING, SE.DELETED): (SS.DELETED, {SA.USER, SA.MAINTENANCE}),
    (SS.LOST, SE.DELETED): (SS.DELETED, {SA.USER}),
    (SS.FAILED, SE.DELETED): (SS.DELETED, {SA.USER}),
}

NODE: dict[tuple[NodeState, NodeEvent], tuple[NodeState, set[Actor]]] = {
    (N.READY, NE.DRAIN): (N.DRAINING, {Actor.OPERATOR}),
    (N.DRAINING, NE.DRAIN): (N.DRAINING, {Actor.OPERATOR}),
    (N.READY, NE.UNDRAIN): (N.READY, {Actor.OPERATOR}),
    (N.DRAINING, NE.UNDRAIN): (N.READY, {Actor.OPERATOR}),
}

CASES: list[tuple[str, Machine, type[StrEnum], type[StrEnum], type[StrEnum], dict]] = [  # type: ignore[type-arg]
    ("reservation", RESERVATION_MACHINE, ReservationPhase, ReservationEvent, Actor, RESERVATION),
    ("sandbox", SANDBOX_MACHINE, SandboxState, SandboxEvent, SandboxActor, SANDBOX),
    ("node", NODE_MACHINE, NodeState, NodeEvent, Actor, NODE),
]


def _pairs() -> list[tuple[str, StrEnum, StrEnum, StrEnum]]:
    return [
        (name, state, event, actor)
        for name, _, states, events, actors, _ in CASES
        for state, event, actor in itertools.product(states, events, actors)
    ]


@pytest.mark.parametrize(("name", "state", "event", "actor"), _pairs(), ids=lambda v: str(v))
def test_every_state_event_actor_triple_matches_the_table(
    name: str, state: StrEnum, event: StrEnum, actor: StrEnum
) -> None:
    machine, expected = next((m, e) for n, m, _, _, _, e in CASES if n == name)
    if (state, event) not in expected:
        with pytest.raises(TransitionRefused) as err:
            machine.transition(state, event, actor)
        assert err.value.code == f"{name}.transition_refused" and err.value.status == 409
        assert err.value.details == {
            "state": state.value,
            "event": event.value,
            "allowed_events": [e.value for e in machine.allowed_events(state)],
        }
        return
    target, actors = expected[(state, event)]
    if actor in actors:
        assert machine.transition(state, event, actor) is target
    else:
        with pytest.raises(TransitionRefused) as err:
            machine.transition(state, event, actor)
        assert err.value.code == f"{name}.actor_not_allowed"
        assert err.value.details == {"state": state.value, "event": event.value, "actor": actor.value}


@pytest.mark.parametrize(("name", "machine", "expected"), [(n, m, e) for n, m, _, _, _, e in CASES])
def test_the_guard_of_each_event_is_where_the_table_lets_that_actor_fire_it(
    name: str,
    machine: Machine,  # type: ignore[type-arg]
    expected: dict,  # type: ignore[type-arg]
) -> None:
    for (_, event), (_, actors) in expected.items():
        for actor in actors:
            want = {s for (s, e), (_, who) in expected.items() if e == event and actor in who}
            assert machine.sources(event, actor) == want, (name, event, actor)


def test_stored_values_are_the_strings_stored_before_the_enums() -> None:
    """No migration: the enums' values are exactly the literals the stores held."""
    assert [p.value for p in ReservationPhase] == ["reserved", "starting", "running", "warm", "releasing"]
    assert [s.value for s in SandboxState] == [
        "scheduling",
        "placing",
        "starting",
        "running",
        "deleting",
        "deleted",
        "failed",
        "lost",
    ]
    assert [n.value for n in NodeState] == ["ready", "draining"]


def test_a_releasing_reservation_goes_nowhere_but_closed() -> None:
    assert RESERVATION_MACHINE.allowed_events(P.RELEASING) == []
    with pytest.raises(TransitionRefused) as err:
        next_phase(P.RELEASING, RE.START)
    assert "'start'" in err.value.message and "'releasing'" in err.value.message


def test_a_deleted_sandbox_is_final_and_only_the_node_makes_a_starting_one_running() -> None:
    assert SANDBOX_MACHINE.allowed_events(SS.DELETED) == []
    assert SANDBOX_MACHINE.sources(SE.READY, SA.CUBELET) == {SS.STARTING}
    for actor in (SA.USER, SA.PLACEMENT, SA.MAINTENANCE):
        assert SS.STARTING not in SANDBOX_MACHINE.sources(SE.READY, actor)


def test_a_user_never_fails_loses_or_times_out_a_sandbox() -> None:
    for event in (SE.FAIL, SE.LOSE, SE.TIMEOUT, SE.CLAIM, SE.STARTED, SE.READY, SE.REFUSED):
        assert SANDBOX_MACHINE.sources(event, SA.USER) == frozenset()


def test_a_table_naming_one_pair_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="two rules"):
        Machine(
            "node",
            "api",
            (
                rule(NE.DRAIN, {N.READY}, N.DRAINING, {Actor.OPERATOR}, "-"),
                rule(NE.DRAIN, {N.READY}, N.READY, {Actor.OPERATOR}, "-"),
            ),
            ("node.transition_refused", "node.actor_not_allowed"),
        )


def test_the_cubelet_store_reads_phases_back_as_the_enum_and_refuses_an_illegal_change(tmp_path: Path) -> None:
    store = Store(tmp_path / "c.db")
    with store.tx() as t:
        t.insert_reservation(Reservation("sb", ReservationParams(), [], P.RESERVED, t.now, None))
    with store.tx() as t:
        res = t.reservation("sb")
        assert res is not None and res.phase is P.RESERVED
        res.fire(RE.START)
        t.update_reservation(res)
    res = store.reservation("sb")
    assert res is not None and res.phase is P.STARTING
    with pytest.raises(TransitionRefused) as err:
        res.fire(RE.START)
    assert err.value.code == "reservation.transition_refused" and err.value.details["allowed_events"] == [
        "ready",
        "teardown",
        "warmed",
    ]
    assert store.reservation("sb").phase is P.STARTING  # type: ignore[union-attr]
    store.close()
