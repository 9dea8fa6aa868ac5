"""The Cubelet reservation's phase machine (a sandbox's claim on devices), as data beside the device table.

A reservation is born `reserved` (a row insert, not a transition) and ends by being deleted once its VMM is
proven gone (the release path's `reservation_closed`), not by a phase. Only Cubelet fires these: shim reports
are evidence it judges, never phase changes of their own. The values are the strings stored in
`reservations.phase` and served in `GET /v1/reservations`.
"""

from __future__ import annotations

from enum import StrEnum

from cubeaccel.model.machine import Machine, rule
from cubeaccel.model.states import Actor


class ReservationPhase(StrEnum):
    RESERVED = "reserved"  # devices reserved, no shim yet; the TTL runs
    STARTING = "starting"  # devices preparing, shim launched (intent recorded first)
    RUNNING = "running"  # every device attached and the guest validated
    WARM = "warm"  # running, owned by the node (no tenant), its workload service refusing everything until a claim
    RELEASING = "releasing"  # teardown began; the release rules decide when the row closes


class ReservationEvent(StrEnum):
    START = "start"
    READY = "ready"
    WARMED = "warmed"  # a warm start's READY: it joins the node's pool instead of a tenant
    CLAIM = "claim"  # a warm reservation becomes a requester's sandbox (renamed, token bound), in one CAS
    TEARDOWN = "teardown"


P, RE = ReservationPhase, ReservationEvent

RESERVATION_MACHINE: Machine[ReservationPhase, ReservationEvent, Actor] = Machine(
    "reservation",
    "cubelet",
    (
        rule(RE.START, {P.RESERVED}, P.STARTING, {Actor.CUBELET}, "devices revalidated and moved to preparing"),
        rule(RE.READY, {P.STARTING}, P.RUNNING, {Actor.CUBELET}, "every device attached, guest validated on host"),
        rule(RE.WARMED, {P.STARTING}, P.WARM, {Actor.CUBELET}, "as ready, for a warm start (no tenant)"),
        rule(RE.CLAIM, {P.WARM}, P.RUNNING, {Actor.CUBELET}, "the request matches the warm sandbox's pool key"),
        rule(
            RE.TEARDOWN,
            {P.RESERVED, P.STARTING, P.RUNNING, P.WARM},
            P.RELEASING,
            {Actor.CUBELET},
            "user delete, expiry, failed start or attach, guest validation failure, VMM exit, health",
        ),
    ),
    ("reservation.transition_refused", "reservation.actor_not_allowed"),
)
RESERVATION_TRANSITIONS = RESERVATION_MACHINE.rules
# A reservation in these phases has (or may have) a shim to ask about.
STARTED_PHASES: frozenset[ReservationPhase] = frozenset({P.STARTING, P.RUNNING, P.WARM})


def next_phase(phase: ReservationPhase, event: ReservationEvent) -> ReservationPhase:
    """The phase after `event`, or `reservation.transition_refused` (409)."""
    return RESERVATION_MACHINE.transition(phase, event, Actor.CUBELET)
