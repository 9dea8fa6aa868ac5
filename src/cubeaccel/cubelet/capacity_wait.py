"""Reserves that wait on the node for devices coming back (a device releasing or being scrubbed), in arrival order,
and what the warm refill yields to.

A create CubeMaster places on capacity that is coming back asks the Cubelet to wait (`capacity_wait_s`): the wait
is here, where the device returns, because between a device turning `allocatable` and CubeMaster hearing of it
(the next heartbeat) anything on the node could take it; the warm refill, woken by that very change, would
(docs/warm.md). A waiting reserve is in the queue before its first attempt, so a refill that reserves after it
joined sees that the device is owed. Only the head of the queue attempts; a change that may free capacity (a
device turning `allocatable`, a reservation closing its pinned memory) or a waiter leaving wakes the queue and
whatever else registered a waker (the warm refill).

Capacity that cannot come back (quarantined, unhealthy, disabled, held by a running sandbox or a warm one) is
refused at once, as a reserve without a wait is.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import count

from cubeaccel.cubelet.store import Event
from cubeaccel.model.event_kinds import EventKind
from cubeaccel.protocol.errors import CubeError, conflict

# The refusals a wait may outlast: free devices or free lockable memory, both of which a release gives back.
CAPACITY_CODES = ("reserve.insufficient_devices", "reserve.pinned_memory_exhausted")


def frees_capacity(kind: str, to_state: str | None) -> bool:
    """A committed event after which a refused reserve may fit: a device back in `allocatable`, or a reservation
    closed (its pinned memory leaves the ledger)."""
    if kind == EventKind.TRANSITION.value:
        return to_state == "allocatable"
    return kind == EventKind.RESERVATION_CLOSED.value


@dataclass(frozen=True)
class Waiter:
    ticket: int
    sandbox_id: str
    accel_class: str | None  # None: any class (such a reserve may take any device)


class CapacityWaits:
    """The node's waiting reserves, oldest first, and a counter of capacity changes (`changes`): a refill that
    was refused for capacity retries once it moved, never on a timer."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: deque[Waiter] = deque()
        self._tickets = count()
        self.changes = 0
        self.wakers: list[Callable[[], None]] = []  # called after each change (the warm refill's poke)

    def on_events(self, events: list[Event]) -> None:
        """`Store.listeners` member: every committed change's events."""
        if any(frees_capacity(e.kind, e.to_state) for e in events):
            self._changed()

    def _changed(self) -> None:
        with self._cond:
            self.changes += 1
            self._cond.notify_all()
        for wake in list(self.wakers):
            wake()

    def owed(self, accel_class: str | None) -> list[str]:
        """Sandboxes waiting for a device a reserve of `accel_class` could take (either side None: any)."""
        with self._cond:
            return [
                w.sandbox_id
                for w in self._queue
                if w.accel_class is None or accel_class is None or w.accel_class == accel_class
            ]

    def __len__(self) -> int:
        with self._cond:
            return len(self._queue)

    @contextmanager
    def queued(self, sandbox_id: str, accel_class: str | None) -> Iterator[Waiter]:
        with self._cond:
            w = Waiter(next(self._tickets), sandbox_id, accel_class)
            self._queue.append(w)
        try:
            yield w
        finally:
            with self._cond:
                self._queue.remove(w)
            self._changed()  # the next waiter's turn; a refill held back for this one may go

    def head(self, w: Waiter) -> bool:
        with self._cond:
            return bool(self._queue) and self._queue[0] == w

    def wait(self, w: Waiter, seen: int, timeout_s: float) -> None:
        """Until capacity changed since `seen` and `w` is the head, or `timeout_s` passed."""
        with self._cond:
            self._cond.wait_for(lambda: self.changes != seen and self._queue[0] == w, max(0.0, timeout_s))


def reserve_waiting(
    waits: CapacityWaits,
    waiter: Waiter,
    attempt: Callable[[], object],
    returning: Callable[[], int],
    wait_s: float,
) -> object:
    """`attempt()` (a reserve) in `waiter`'s turn, again after each capacity change, until it succeeds, fails for
    another reason, nothing that fits is coming back, or `wait_s` passed (then the last refusal, with
    `waited_s` and `returning_devices` added)."""
    t0 = time.monotonic()
    deadline = t0 + wait_s
    while True:
        seen = waits.changes
        if waits.head(waiter):
            try:
                return attempt()
            except CubeError as e:
                if not e.code.startswith(CAPACITY_CODES):
                    raise
                back = returning()
                if not back or time.monotonic() >= deadline:
                    e.details.update({"returning_devices": back, "waited_s": round(time.monotonic() - t0, 3)})
                    raise
        elif time.monotonic() >= deadline:
            raise conflict(
                "reserve.insufficient_devices",
                f"sandbox {waiter.sandbox_id} waited {wait_s:g}s behind earlier reserves for devices coming back",
                details={"waited_s": round(time.monotonic() - t0, 3)},
            )
        waits.wait(waiter, seen, deadline - time.monotonic())
