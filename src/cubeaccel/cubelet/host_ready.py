"""Host readiness: the backend's host-wide prerequisites, checked before anything is advertised and on every
reconcile tick.

Where passthrough cannot work (no IOMMU, a PVM host, no interrupt remapping, no vfio-pci) no device of the
backend may become allocatable, whatever each device looks like: devices stay `initialized` with the first
`host.*` code as their reason, an allocatable device goes back to `initialized` (`host_not_ready`), reservations
are refused (`host.not_ready`) and the heartbeat says `ready: false` with the codes. When a later check passes,
`initialized` devices are validated as usual: no operator is needed for devices that never served a tenant.

The last result lives in the store's meta table, so the heartbeat, the API and `reserve` read one answer, and
a change (not every tick) is one `host_ready` / `host_not_ready` event.
"""

from __future__ import annotations

import json
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from cubeaccel.backends.base import Backend, Problem
from cubeaccel.cubelet.store import Store, Tx
from cubeaccel.model.event_kinds import EventKind
from cubeaccel.model.states import Actor, DeviceEvent, DeviceState
from cubeaccel.protocol.errors import CubeError

META_KEY = "host_readiness"
NOT_CHECKED = Problem("host.not_checked", "host readiness has not been checked yet")


class ReadinessHost(Protocol):
    """What a check needs of `lifecycle.Cubelet` (which imports this module, so neither it nor `ports.py`, which
    names lifecycle's types, is imported here)."""

    @property
    def backend(self) -> Backend: ...

    @property
    def store(self) -> Store: ...

    @property
    def lock(self) -> AbstractContextManager[Any]: ...


@dataclass(frozen=True)
class Readiness:
    problems: tuple[Problem, ...]
    checked_at: float | None

    @property
    def ready(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {
            "ready": self.ready,
            "checked_at": self.checked_at,
            "problems": [{"code": p.code, "message": p.message} for p in self.problems],
        }


def current(t: Tx) -> Readiness:
    """The last check's answer; never checked counts as not ready (fail closed)."""
    raw = t.meta(META_KEY)
    if raw is None:
        return Readiness((NOT_CHECKED,), None)
    data = json.loads(raw)
    return Readiness(tuple(Problem(p["code"], p["message"]) for p in data["problems"]), data["checked_at"])


def check(cubelet: ReadinessHost) -> Readiness:
    """Run the backend's readiness checks, record the answer, and hold devices back while it fails."""
    problems = tuple(cubelet.backend.readiness())
    with cubelet.lock:
        with cubelet.store.tx() as t:
            before = current(t)
            now = Readiness(problems, t.now)
            t.set_meta(META_KEY, json.dumps(now.to_json()))
            codes = [p.code for p in problems]
            if [p.code for p in before.problems] != codes or before.checked_at is None:
                t.event(
                    EventKind.HOST_READY if now.ready else EventKind.HOST_NOT_READY,
                    Actor.CUBELET,
                    reason=codes[0] if codes else None,
                    details={**now.to_json(), "was": before.to_json()},
                )
        if not now.ready:
            _hold(cubelet, problems)
    return now


def _hold(cubelet: ReadinessHost, problems: tuple[Problem, ...]) -> None:
    """Nothing of this backend is allocatable on a host that cannot serve it; the reason says why."""
    reason = problems[0].code
    detail = {"problems": [{"code": p.code, "message": p.message} for p in problems]}
    with cubelet.store.tx() as t:
        for d in t.devices():
            if d.state is DeviceState.ALLOCATABLE:
                t.transition(d, DeviceEvent.HOST_NOT_READY, Actor.CUBELET, reason=reason, details=detail)
            elif d.state is DeviceState.INITIALIZED and d.reason != reason:
                t.set_reason(d, reason)


def refuse_if_not_ready(t: Tx) -> None:
    """Inside `reserve`'s transaction: a host that cannot serve its backend reserves nothing."""
    r = current(t)
    if r.ready:
        return
    codes = ", ".join(p.code for p in r.problems)
    raise CubeError(
        "host.not_ready",
        f"this node's host is not ready for its backend ({codes}): {r.problems[0].message}",
        "host_hardware",
        r.to_json(),
    )
