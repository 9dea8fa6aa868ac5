"""The device state machine as data (ARCHITECTURE §3). The table is the spec; tests enumerate it."""

from __future__ import annotations

from enum import StrEnum

from cubeaccel.model.machine import Machine, Rule, rule


class DeviceState(StrEnum):
    INITIALIZED = "initialized"
    ALLOCATABLE = "allocatable"
    RESERVED = "reserved"
    PREPARING = "preparing"
    ATTACHED = "attached"
    RELEASING = "releasing"
    RELEASED = "released"
    UNHEALTHY = "unhealthy"
    QUARANTINED = "quarantined"
    DISABLED = "disabled"


class DeviceEvent(StrEnum):
    VALIDATED = "validated"
    HOST_NOT_READY = "host_not_ready"
    RESERVE = "reserve"
    PREPARE = "prepare"
    ATTACH_SUCCEEDED = "attach_succeeded"
    STARTUP_FAILED = "startup_failed"
    ATTACH_FAILED = "attach_failed"
    TEARDOWN = "teardown"
    RELEASE_CONFIRMED = "release_confirmed"
    REVALIDATED = "revalidated"
    HEALTH_FAILED = "health_failed"
    QUARANTINE = "quarantine"
    RECOVER = "recover"
    RECOVER_SCRUB = "recover_scrub"  # the operator's recover of a device whose last tenant's scrub is still owed
    RETRY = "retry"  # Cubelet's own bounded retry of a transient quarantine (model/recovery.py)
    DISABLE = "disable"
    ENABLE = "enable"


class Actor(StrEnum):
    CUBELET = "cubelet"
    SHIM = "shim"
    OPERATOR = "operator"


S = DeviceState
E = DeviceEvent

# A tenant (sandbox) may hold the device in these states.
TENANT_STATES: frozenset[DeviceState] = frozenset({S.RESERVED, S.PREPARING, S.ATTACHED, S.RELEASING})
ACTIVE_STATES: frozenset[DeviceState] = frozenset(
    {S.INITIALIZED, S.ALLOCATABLE, S.RESERVED, S.PREPARING, S.ATTACHED, S.RELEASING, S.RELEASED}
)
# Safety can be in doubt in every state but the two operator-owned parking states.
UNCERTAIN_STATES: frozenset[DeviceState] = ACTIVE_STATES | {S.UNHEALTHY}


Transition = Rule  # the device table's rows: (event, sources, target, fired_by, precondition)


def _t(event: E, sources: set[S] | frozenset[S], target: S, by: set[Actor], pre: str) -> Transition[S, E, Actor]:
    return rule(event, sources, target, by, pre)


C, SH, OP = Actor.CUBELET, Actor.SHIM, Actor.OPERATOR

TRANSITIONS: tuple[Transition[S, E, Actor], ...] = (
    _t(E.VALIDATED, {S.INITIALIZED}, S.ALLOCATABLE, {C}, "driver binding, viable IOMMU group, no holders"),
    _t(E.HOST_NOT_READY, {S.ALLOCATABLE}, S.INITIALIZED, {C}, "host readiness failed; no tenant holds it"),
    _t(E.RESERVE, {S.ALLOCATABLE}, S.RESERVED, {C}, "atomic; records sandbox, template, contract, memory"),
    _t(E.PREPARE, {S.RESERVED}, S.PREPARING, {C}, "backend revalidated host state; CAS on the reserved generation"),
    _t(E.ATTACH_SUCCEEDED, {S.PREPARING}, S.ATTACHED, {SH}, "VMM confirmed the device; guest saw it"),
    _t(E.STARTUP_FAILED, {S.RESERVED, S.PREPARING}, S.RELEASING, {C}, "cleanup must run"),
    _t(E.ATTACH_FAILED, {S.RESERVED, S.PREPARING}, S.RELEASING, {SH, C}, "cleanup must run"),
    _t(E.TEARDOWN, {S.ATTACHED}, S.RELEASING, {C}, "sandbox stop, guest validation failure, timeout"),
    _t(
        E.RELEASE_CONFIRMED, {S.RELEASING}, S.RELEASED, {C}, "VMM exited, shim exited or final report, no holder, reset"
    ),
    _t(E.REVALIDATED, {S.RELEASED}, S.ALLOCATABLE, {C}, "host state equals expected state"),
    _t(E.HEALTH_FAILED, ACTIVE_STATES, S.UNHEALTHY, {C}, "hard failure seen"),
    _t(E.QUARANTINE, UNCERTAIN_STATES, S.QUARANTINED, {C, OP}, "safety cannot be proven"),
    _t(E.RECOVER, {S.QUARANTINED, S.UNHEALTHY}, S.ALLOCATABLE, {OP}, "Cubelet revalidation passes; nothing owed"),
    _t(
        E.RECOVER_SCRUB,
        {S.QUARANTINED, S.UNHEALTHY},
        S.RELEASED,
        {OP},
        "revalidation passes; a tenant's leftovers are not proven gone, so the scrub runs first",
    ),
    # Never straight to allocatable: back to `released`, so the scrub (where owed) and revalidation run again.
    _t(E.RETRY, {S.QUARANTINED}, S.RELEASED, {C}, "transient reason, within the retry bound; probe passed, reset"),
    _t(E.DISABLE, set(DeviceState) - {S.DISABLED}, S.DISABLED, {OP}, "-"),
    _t(E.ENABLE, {S.DISABLED}, S.INITIALIZED, {OP}, "-"),
)

DEVICE_MACHINE: Machine[DeviceState, DeviceEvent, Actor] = Machine(
    "device", "cubelet", TRANSITIONS, ("state.transition_refused", "state.actor_not_allowed")
)


def allowed_events(state: DeviceState) -> list[DeviceEvent]:
    return DEVICE_MACHINE.allowed_events(state)


def lookup(state: DeviceState, event: DeviceEvent) -> Transition[S, E, Actor] | None:
    return DEVICE_MACHINE.lookup(state, event)


def transition(state: DeviceState, event: DeviceEvent, actor: Actor) -> DeviceState:
    """Return the target state or refuse, naming the current state, the event and what is allowed."""
    return DEVICE_MACHINE.transition(state, event, actor)
