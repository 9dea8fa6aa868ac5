"""The transition table is the spec: every (state, event) pair is checked against it."""

from __future__ import annotations

import itertools

import pytest

from cubeaccel.model.machine import TransitionRefused
from cubeaccel.model.states import (
    TRANSITIONS,
    Actor,
    DeviceEvent,
    DeviceState,
    allowed_events,
    lookup,
    transition,
)

S, E = DeviceState, DeviceEvent

# The ARCHITECTURE §3 table, written out independently of the implementation's encoding.
EXPECTED: dict[tuple[DeviceState, DeviceEvent], DeviceState] = {
    (S.INITIALIZED, E.VALIDATED): S.ALLOCATABLE,
    (S.ALLOCATABLE, E.HOST_NOT_READY): S.INITIALIZED,
    (S.ALLOCATABLE, E.RESERVE): S.RESERVED,
    (S.RESERVED, E.PREPARE): S.PREPARING,
    (S.PREPARING, E.ATTACH_SUCCEEDED): S.ATTACHED,
    (S.RESERVED, E.STARTUP_FAILED): S.RELEASING,
    (S.PREPARING, E.STARTUP_FAILED): S.RELEASING,
    (S.RESERVED, E.ATTACH_FAILED): S.RELEASING,
    (S.PREPARING, E.ATTACH_FAILED): S.RELEASING,
    (S.ATTACHED, E.TEARDOWN): S.RELEASING,
    (S.RELEASING, E.RELEASE_CONFIRMED): S.RELEASED,
    (S.RELEASED, E.REVALIDATED): S.ALLOCATABLE,
    (S.QUARANTINED, E.RECOVER): S.ALLOCATABLE,
    (S.UNHEALTHY, E.RECOVER): S.ALLOCATABLE,
    (S.QUARANTINED, E.RECOVER_SCRUB): S.RELEASED,
    (S.UNHEALTHY, E.RECOVER_SCRUB): S.RELEASED,
    (S.DISABLED, E.ENABLE): S.INITIALIZED,
    (S.QUARANTINED, E.RETRY): S.RELEASED,
}
ACTIVE = [S.INITIALIZED, S.ALLOCATABLE, S.RESERVED, S.PREPARING, S.ATTACHED, S.RELEASING, S.RELEASED]
for s in ACTIVE:
    EXPECTED[(s, E.HEALTH_FAILED)] = S.UNHEALTHY
for s in [*ACTIVE, S.UNHEALTHY]:
    EXPECTED[(s, E.QUARANTINE)] = S.QUARANTINED
for s in DeviceState:
    if s is not S.DISABLED:
        EXPECTED[(s, E.DISABLE)] = S.DISABLED


def _actor_for(state: DeviceState, event: DeviceEvent) -> Actor:
    t = lookup(state, event)
    assert t is not None
    return sorted(t.fired_by)[0]


@pytest.mark.parametrize(("state", "event"), list(itertools.product(DeviceState, DeviceEvent)))
def test_every_state_event_pair_matches_the_table(state: DeviceState, event: DeviceEvent) -> None:
    if (state, event) in EXPECTED:
        assert transition(state, event, _actor_for(state, event)) is EXPECTED[(state, event)]
    else:
        for actor in Actor:
            with pytest.raises(TransitionRefused) as err:
                transition(state, event, actor)
            assert err.value.code == "state.transition_refused"
            assert err.value.details["state"] == state.value
            assert err.value.details["event"] == event.value
            assert err.value.details["allowed_events"] == [e.value for e in allowed_events(state)]


def test_refusal_message_names_state_event_and_allowed_events() -> None:
    with pytest.raises(TransitionRefused) as err:
        transition(S.ATTACHED, E.REVALIDATED, Actor.CUBELET)
    msg = err.value.message
    assert "'revalidated'" in msg and "'attached'" in msg and "teardown" in msg


def test_only_an_operator_recovers_enables_or_disables() -> None:
    for state, event in [(S.QUARANTINED, E.RECOVER), (S.DISABLED, E.ENABLE), (S.ALLOCATABLE, E.DISABLE)]:
        for actor in (Actor.CUBELET, Actor.SHIM):
            with pytest.raises(TransitionRefused) as err:
                transition(state, event, actor)
            assert err.value.code == "state.actor_not_allowed"
        transition(state, event, Actor.OPERATOR)


def test_only_cubelet_retries_a_quarantine_and_only_back_to_released() -> None:
    for actor in (Actor.OPERATOR, Actor.SHIM):
        with pytest.raises(TransitionRefused) as err:
            transition(S.QUARANTINED, E.RETRY, actor)
        assert err.value.code == "state.actor_not_allowed"
    assert transition(S.QUARANTINED, E.RETRY, Actor.CUBELET) is S.RELEASED  # scrub and revalidation run again
    assert {t.sources for t in TRANSITIONS if t.event is E.RETRY} == {frozenset({S.QUARANTINED})}


def test_the_shim_only_reports_attach_outcomes() -> None:
    shim_events = {t.event for t in TRANSITIONS if Actor.SHIM in t.fired_by}
    assert shim_events == {E.ATTACH_SUCCEEDED, E.ATTACH_FAILED}


def test_nothing_but_revalidation_or_recovery_reaches_allocatable() -> None:
    into_allocatable = {t.event for t in TRANSITIONS if t.target is S.ALLOCATABLE}
    assert into_allocatable == {E.VALIDATED, E.REVALIDATED, E.RECOVER}
    assert lookup(S.RELEASING, E.REVALIDATED) is None  # released is not allocatable
