"""What a CubeMaster create writes on its sandbox's timeline (`TimelineEntry`'s detail fields, after `at` and
`phase`) and into its errors' `attempts`: one model per entry kind. Their JSON is the stored timeline's, as the
replies show it: keys in declaration order, and an optional key left out when the create had nothing for it."""

from __future__ import annotations

from typing import Any, Literal

from cubeaccel.wire.base import Record, Sparse
from cubeaccel.wire.cubelet_api import TimelineEntry as CubeletStep


class ReserveAttempt(Record):
    """A Cubelet that refused a cold reservation or could not be reached (`reserve_refused`, and `attempts` in a
    `schedule.*` error)."""

    node: str
    code: str
    message: str


class WarmAttempt(Record):
    """A warm claim the Cubelet refused or that did not arrive (`warm_claim_refused`, and the cold path's
    `warm_attempts`)."""

    node: str
    warm_id: str
    code: str
    reason: Any = None  # the refusal's own `reason` detail, as the Cubelet gave it
    message: str


class Scheduled(Record):
    """`scheduled`: the candidate a cold placement claimed, and how long deciding took."""

    node: str
    decision_ms: float
    group: dict[str, str]  # the candidate group's summary labels
    score: list[float]  # larger is better (master/scheduler.score)


class ColdPath(Sparse):
    """`path` on the cold path: why, the warm claims that failed, and warm starts on their way (only when no
    pool had one ready)."""

    path: Literal["cold"]
    reason: str
    warm_attempts: list[WarmAttempt] = []
    refilling: int | None = None

    @classmethod
    def of(cls, reason: str, tried: list[WarmAttempt], refilling: int | None) -> ColdPath:
        given: dict[str, Any] = {"warm_attempts": tried} if tried else {}
        if refilling is not None:
            given["refilling"] = refilling
        return cls(path="cold", reason=reason, **given)


class WarmPath(Record):
    """`path` on the warm path: the warm sandbox the create's claim row took."""

    path: Literal["warm"] = "warm"
    node: str
    warm_id: str
    pool: str


class ClaimPhases(Record):
    """A warm create's phases in ms (master/warm.claim_phases says what each covers); None: not reported."""

    master_ms: float
    claim_ms: float
    cas_ms: float | None
    reseed_ms: float | None
    rebind_ms: float | None
    claim_other_ms: float


class Reserved(Sparse):
    """`reserved`: the node's answer to a reservation or a warm claim (with the claim's timing), and its last
    steps of the start."""

    node: str
    path: Literal["warm"] | None = None
    claim_ms: float | None = None
    phases: ClaimPhases | None = None
    cubelet_timeline: list[CubeletStep]


class Recovered(Record):
    """`reserved` by maintenance: a placement whose create died, found running on its node."""

    node: str | None
    recovered: Literal[True] = True


class AbandonedDelete(Record):
    """`delete_requested` for a sandbox whose create died while placing it."""

    abandoned_in: str  # the placement state it was left in


class TimeoutSet(Record):
    """`timeout_set`: the new lifetime, from now."""

    timeout_s: float


class NetworkSet(Record):
    """`network_set`: a running sandbox's egress policy changed in place: the narrowing asked for (it replaces the
    create's whole) and the effective allowlist its node loaded."""

    network: dict[str, Any]
    egress: list[str]


WORKLOAD_UNRESPONSIVE = "workload_unresponsive"
WORKLOAD_RECOVERED = "workload_recovered"


class WorkloadChanged(Sparse):
    """`workload_unresponsive` / `workload_recovered`: the node said the sandbox's workload service stopped, or
    started again, answering. The sandbox's `workload` condition is read from the last of these, so the timeline
    stays the one place it is stored (no column of its own)."""

    since: float  # the Cubelet's clock when the shim reported it
    reason: str | None = None
    message: str | None = None
