"""Creates that wait for capacity coming back (issue 29): a device being released or scrubbed, or held by a
sandbox being deleted, is capacity a create may wait for, within a bound, in arrival order. Capacity that cannot
come back (quarantined, unhealthy, disabled, held by a running sandbox) is refused at once, as before."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Mapping
from itertools import count

from cubeaccel.master.scheduler import Decision
from cubeaccel.master.view import NodeView
from cubeaccel.protocol.errors import CubeError


def returning(decision: Decision, views: Mapping[str, NodeView], deleting: Mapping[str, Mapping[str, int]]) -> int:
    """Devices coming back that would turn a node's `insufficient_devices` into a fit: matching the refused
    choice's class and model, on a node that refused it for its free count alone."""
    back_total = 0
    for out in decision.outcomes:
        ch = out.choice
        for node, reason in out.reasons.items():
            v = views.get(node)
            if reason.code != "insufficient_devices" or v is None:
                continue
            for g in v.groups:
                if g.accel_class != ch.accel_class or not ch.model_matches(g.labels.get("model", "")):
                    continue
                back = g.returning + deleting.get(node, {}).get(g.key, 0)
                if back and v.free(g) + back >= ch.count:
                    back_total += back
    return back_total


def expired(back: int, waited_s: float, why: str) -> CubeError:
    return CubeError(
        "schedule.capacity_returning",
        f"no matching device is free yet: {back} device(s) that fit are being released or scrubbed, and {why} "
        f"(waited {waited_s:.1f}s); retry",
        "scheduler",
        {"returning_devices": back, "waited_s": round(waited_s, 3)},
    )


class ArrivalQueue:
    """Waiting creates take turns in arrival order: only the head decides again; it leaves after its placement
    (its claim is then in every decision), waking the next. At most `limit` wait per replica, since each holds a
    worker thread."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._cond = threading.Condition()
        self._queue: deque[int] = deque()
        self._tickets = count()

    def join(self) -> int | None:
        with self._cond:
            if len(self._queue) >= self.limit:
                return None
            t = next(self._tickets)
            self._queue.append(t)
            return t

    def wait_turn(self, ticket: int, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._queue[0] == ticket, timeout_s)

    def pause(self, seconds: float) -> None:
        """The head waits for capacity to change (the next heartbeat); another create leaving wakes it early."""
        with self._cond:
            self._cond.wait(seconds)

    def leave(self, ticket: int) -> None:
        with self._cond:
            self._queue.remove(ticket)
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._queue)
