"""What a create writes on its sandbox's timeline and into its errors: each timeline entry's detail and each
placement attempt is a record here, written as the JSON the timeline and the error details always carried (keys
in the same order, optional keys only when they have something)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cubeaccel.master.scheduler import Candidate
from cubeaccel.wire.cubelet_api import ReservationView
from cubeaccel.wire.cubelet_api import TimelineEntry as CubeletStep

CUBELET_STEPS_KEPT = 20  # the Cubelet's last steps of a start kept in the sandbox's timeline


def cubelet_steps(reply: ReservationView) -> tuple[CubeletStep, ...]:
    """The Cubelet's last steps of the start, kept in the sandbox's detail."""
    return tuple(reply.timeline[-CUBELET_STEPS_KEPT:])


@dataclass(frozen=True)
class ReserveAttempt:
    """A Cubelet that refused a cold reservation or could not be reached (timeline and `attempts` in errors)."""

    node: str
    code: str
    message: str

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "code": self.code, "message": self.message}


@dataclass(frozen=True)
class WarmAttempt:
    """A warm claim a Cubelet refused or that did not arrive (`warm_claim_refused`, and the cold path's
    `warm_attempts`)."""

    node: str
    warm_id: str
    code: str
    reason: Any  # the refusal's own `reason` detail, as the Cubelet gave it (None without one)
    message: str

    def to_json(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "warm_id": self.warm_id,
            "code": self.code,
            "reason": self.reason,
            "message": self.message,
        }


@dataclass(frozen=True)
class Scheduled:
    """The candidate a cold placement claimed, and how long deciding took."""

    node: str
    decision_ms: float
    candidate: Candidate

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "decision_ms": self.decision_ms, **self.candidate.to_json()}


@dataclass(frozen=True)
class ColdPath:
    """Why the create took the cold path: the warm claims that failed, and warm starts on their way."""

    reason: str
    warm_attempts: tuple[WarmAttempt, ...] = ()
    refilling: int | None = None  # only when no pool had one ready

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": "cold", "reason": self.reason}
        if self.warm_attempts:
            out["warm_attempts"] = [a.to_json() for a in self.warm_attempts]
        if self.refilling is not None:
            out["refilling"] = self.refilling
        return out


@dataclass(frozen=True)
class WarmPath:
    """The warm sandbox a create's claim row took."""

    node: str
    warm_id: str
    pool: str

    def to_json(self) -> dict[str, Any]:
        return {"path": "warm", "node": self.node, "warm_id": self.warm_id, "pool": self.pool}


@dataclass(frozen=True)
class ClaimPhases:
    """A warm create's phases in ms (master/warm.claim_phases says what each covers); None: not reported."""

    master_ms: float
    claim_ms: float
    cas_ms: float | None
    reseed_ms: float | None
    rebind_ms: float | None
    claim_other_ms: float

    def to_json(self) -> dict[str, Any]:
        return {
            "master_ms": self.master_ms,
            "claim_ms": self.claim_ms,
            "cas_ms": self.cas_ms,
            "reseed_ms": self.reseed_ms,
            "rebind_ms": self.rebind_ms,
            "claim_other_ms": self.claim_other_ms,
        }


@dataclass(frozen=True)
class WarmClaimTiming:
    claim_ms: float
    phases: ClaimPhases


@dataclass(frozen=True)
class Reserved:
    """The node's answer to a reservation or a warm claim: its last steps, and a warm claim's timing."""

    node: str
    cubelet_timeline: tuple[CubeletStep, ...]
    warm: WarmClaimTiming | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"node": self.node}
        if self.warm is not None:
            out |= {"path": "warm", "claim_ms": self.warm.claim_ms, "phases": self.warm.phases.to_json()}
        return out | {"cubelet_timeline": [e.model_dump(mode="json") for e in self.cubelet_timeline]}


@dataclass(frozen=True)
class Recovered:
    """A placement whose create died, found running on its node by maintenance."""

    node: str | None

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "recovered": True}


@dataclass(frozen=True)
class AbandonedDelete:
    """A delete of a sandbox whose create died while placing it."""

    abandoned_in: str  # the placement state it was left in

    def to_json(self) -> dict[str, Any]:
        return {"abandoned_in": self.abandoned_in}


@dataclass(frozen=True)
class TimeoutSet:
    timeout_s: float

    def to_json(self) -> dict[str, Any]:
        return {"timeout_s": self.timeout_s}
