"""Creates that wait for capacity coming back: a device being released or scrubbed, or held by a sandbox being
deleted, is capacity a create may wait for, within a bound, in arrival order. Capacity that cannot come back
(quarantined, unhealthy, disabled, held by a running sandbox) is refused at once, as before.

Where the node's Cubelet can wait (`reserve_waits`), the head of the queue is placed on the returning capacity
and its reserve waits on the node (cubelet/capacity_wait.py): the device is owed to it there from the start, so
nothing on the node (the warm refill, woken by the same change) takes it between its return and CubeMaster
hearing of it. A node that refuses a reservation for capacity its summary still showed free has capacity in
motion: the create waits, in turn, for a heartbeat from it sent after the refusal, and decides again."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import count

from cubeaccel.master.scheduler import Decision
from cubeaccel.master.view import Group, NodeView
from cubeaccel.protocol.errors import CubeError

# A Cubelet's refusals that say its capacity is taken or in motion, not that the request cannot fit there.
CAPACITY_REFUSALS = ("reserve.insufficient_devices", "reserve.pinned_memory_exhausted")


@dataclass(frozen=True)
class Returning:
    """A group whose devices coming back would fit the refused choice: where a waiting create may be placed."""

    node: NodeView
    group: Group
    back: int
    alternative: int  # which of the request's alternatives it fits (its index in the decision's outcomes)


def returning(decision: Decision, views: Mapping[str, NodeView], deleting: Mapping[str, Mapping[str, int]]) -> int:
    """Devices coming back that would turn a node's `insufficient_devices` into a fit."""
    return sum(r.back for r in returning_groups(decision, views, deleting))


def returning_groups(
    decision: Decision, views: Mapping[str, NodeView], deleting: Mapping[str, Mapping[str, int]]
) -> list[Returning]:
    """Groups whose devices coming back would turn a node's `insufficient_devices` into a fit: matching the
    refused choice's class and model, on a node that refused it for its free count alone; most coming back
    first, then by node name."""
    out: list[Returning] = []
    for i, out_ in enumerate(decision.outcomes):
        ch = out_.choice
        for node, reason in out_.reasons.items():
            v = views.get(node)
            if reason.code != "insufficient_devices" or v is None:
                continue
            for g in v.groups:
                if g.accel_class != ch.accel_class or not ch.model_matches(g.labels.get("model", "")):
                    continue
                back = g.returning + deleting.get(node, {}).get(g.key, 0)
                if back and v.free(g) + back >= ch.count:
                    out.append(Returning(v, g, back, i))
    return sorted(out, key=lambda r: (r.alternative, -r.back, r.node.name))


def expired(back: int, waited_s: float, why: str) -> CubeError:
    return CubeError(
        "schedule.capacity_returning",
        f"no matching device is free yet: {back} device(s) that fit are being released or scrubbed, and {why} "
        f"(waited {waited_s:.1f}s); retry",
        "scheduler",
        {"returning_devices": back, "waited_s": round(waited_s, 3)},
    )


@dataclass
class Turn:
    """One create's wait for capacity: its bound, counted from the start of its placement, and its place among
    the creates waiting (a ticket, once it first had to wait; given back when the create leaves placement)."""

    queue: ArrivalQueue
    bound_s: float
    since: float = field(default_factory=time.monotonic)
    ticket: int | None = None

    def left(self) -> float:
        return self.since + self.bound_s - time.monotonic()

    def join(self, back: int) -> None:
        if not self.try_join():
            raise expired(back, 0.0, f"{self.queue.limit} creates are already waiting for capacity")

    def try_join(self) -> bool:
        """Take a ticket (once); False when `limit` creates wait already."""
        if self.ticket is None:
            self.ticket = self.queue.join()
        return self.ticket is not None

    def wait_turn(self, back: int) -> None:
        """Until this create heads the queue; `schedule.capacity_returning` once the bound passed."""
        assert self.ticket is not None
        left = self.left()
        if left <= 0 or not self.queue.wait_turn(self.ticket, left):
            raise self.expired(back)

    def expired(self, back: int) -> CubeError:
        return expired(back, time.monotonic() - self.since, f"they were not back within {self.bound_s:g}s")

    def pause(self) -> None:
        """The head waits for capacity to change (the next heartbeat); another create leaving wakes it early."""
        self.queue.pause(min(0.25, max(0.0, self.left())))

    def leave(self) -> None:
        if self.ticket is not None:
            self.queue.leave(self.ticket)
            self.ticket = None


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
