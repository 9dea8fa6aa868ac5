"""The sandboxes this Cubelet process ended on its own, for its heartbeats (issue 30 #8).

A status push says the same thing once, and only when the push thread is up and CubeMaster answers; a Cubelet
that restarts ends its dead sandboxes in its startup reconcile, before anything is pushed. So each heartbeat
repeats the recent ends, and CubeMaster applies them idempotently: a missed push costs one heartbeat interval.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from cubeaccel.model.checkpoint import SandboxFailure
from cubeaccel.wire.heartbeat import EndedSandbox
from cubeaccel.wire.master_api import StatusError

KEEP = 256  # at most this many ends ride on a heartbeat
KEEP_S = 300.0  # and none older: CubeMaster has had many heartbeats to learn it


class EndedSandboxes:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ended: deque[tuple[float, EndedSandbox]] = deque(maxlen=KEEP)

    def record(self, sandbox_id: str, created_at: float, error: StatusError) -> None:
        """`created_at`: the reservation's, so CubeMaster never fails a later sandbox that reuses the id."""
        with self._lock:
            self._ended.append(
                (time.monotonic(), EndedSandbox(sandbox_id=sandbox_id, created_at=created_at, error=error))
            )

    def recent(self) -> list[EndedSandbox]:
        cutoff = time.monotonic() - KEEP_S
        with self._lock:
            while self._ended and self._ended[0][0] < cutoff:
                self._ended.popleft()
            return [e for _, e in self._ended]


def status_error(failure: SandboxFailure) -> StatusError:
    """The failure within the wire's bounds."""
    return StatusError(
        code=failure.code[:200],
        layer=failure.layer[:64],
        message=failure.message[:2000],
        phase=failure.phase[:32],
    )
