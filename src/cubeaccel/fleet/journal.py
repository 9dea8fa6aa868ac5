"""The simulated nodes' journals, in memory: what a Cubelet's SQLite journal decides, without the disk.

A real Cubelet hands a device out only through one CAS on its journal (`allocatable → reserved`), so a device is
never held by two sandboxes on one node. The simulator keeps that rule (`NodeJournal.reserve` takes free devices
under the node's lock), and the fleet keeps its own record of every hand-out (`FleetLedger`), independent of
CubeMaster's: a sandbox id held on two nodes at once, or a device given while held, is a double placement the
benchmark counts from here, never from CubeMaster's rows.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from cubeaccel.model.reservation_states import ReservationPhase
from cubeaccel.protocol.errors import conflict, not_found


@dataclass
class SimReservation:
    sandbox_id: str
    params: dict[str, Any]  # the reservation body's fields the journal stores (ReservationParamsShown)
    device_ids: tuple[str, ...]
    phase: ReservationPhase
    created_at: float
    expires_at: float | None


@dataclass
class FleetLedger:
    """Who holds each device, fleet-wide, as the nodes handed them out; the benchmark's source of truth."""

    holders: dict[tuple[str, str], str] = field(default_factory=dict)  # (node, device) → sandbox
    placed: dict[str, str] = field(default_factory=dict)  # sandbox → the node holding it
    double_placements: int = 0  # a sandbox reserved on a second node while held on one, or a device given twice
    handed_out: int = 0
    released: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def hand_out(self, node: str, sandbox_id: str, devices: tuple[str, ...]) -> None:
        with self._lock:
            other = self.placed.get(sandbox_id)
            if other is not None and other != node:
                self.double_placements += 1
            self.placed[sandbox_id] = node
            for d in devices:
                if (node, d) in self.holders:
                    self.double_placements += 1
                self.holders[(node, d)] = sandbox_id
            self.handed_out += 1

    def give_back(self, node: str, sandbox_id: str, devices: tuple[str, ...]) -> None:
        with self._lock:
            if self.placed.get(sandbox_id) == node:
                del self.placed[sandbox_id]
            for d in devices:
                if self.holders.get((node, d)) == sandbox_id:
                    del self.holders[(node, d)]
            self.released += 1

    def held(self) -> int:
        with self._lock:
            return len(self.holders)


class NodeJournal:
    """One simulated node's devices and reservations; every change under the node's lock (the CAS)."""

    def __init__(self, name: str, devices: int, ledger: FleetLedger) -> None:
        self.name = name
        self.device_ids = tuple(f"{name}-gpu{i}" for i in range(devices))
        self.ledger = ledger
        self.holder: dict[str, str] = {}  # device → sandbox
        self.reservations: dict[str, SimReservation] = {}
        self.lock = threading.Lock()

    @property
    def free(self) -> int:
        return len(self.device_ids) - len(self.holder)

    def free_by_numa(self) -> dict[str, int]:
        """Devices 0-3 on NUMA node 0, 4-7 on 1, as an 8-GPU server is laid out."""
        half = len(self.device_ids) // 2
        out = {"0": 0, "1": 0}
        for i, d in enumerate(self.device_ids):
            if d not in self.holder:
                out["0" if i < half else "1"] += 1
        return out

    def reserve(self, sandbox_id: str, count: int, params: dict[str, Any], lifetime_s: float | None) -> SimReservation:
        """The journal's CAS: `count` free devices for `sandbox_id`, or the refusal a Cubelet gives. The same
        sandbox id with the same parameters is the same reservation (a retried call), never a second one."""
        with self.lock:
            held = self.reservations.get(sandbox_id)
            if held is not None:
                if held.params != params:
                    raise conflict("reserve.sandbox_conflict", f"sandbox {sandbox_id} is reserved with other params")
                return held
            free = [d for d in self.device_ids if d not in self.holder]
            if count < 1 or len(free) < count:
                raise conflict(
                    "reserve.insufficient_devices",
                    f"{self.name}: {len(free)} allocatable device(s), {count} asked",
                    details={"allocatable": len(free), "requested": count},
                )
            taken = tuple(free[:count])
            for d in taken:
                self.holder[d] = sandbox_id
            now = time.time()
            res = SimReservation(
                sandbox_id,
                params,
                taken,
                ReservationPhase.RUNNING,
                now,
                None if lifetime_s is None else now + lifetime_s,
            )
            self.reservations[sandbox_id] = res
            self.ledger.hand_out(self.name, sandbox_id, taken)
            return res

    def release(self, sandbox_id: str) -> SimReservation:
        """The release path, completed at once: the devices are allocatable again (the simulator has no VMM)."""
        with self.lock:
            res = self.reservations.pop(sandbox_id, None)
            if res is None:
                raise not_found("reservation.not_found", f"no reservation for sandbox {sandbox_id!r}")
            for d in res.device_ids:
                self.holder.pop(d, None)
            self.ledger.give_back(self.name, sandbox_id, res.device_ids)
            return res

    def get(self, sandbox_id: str) -> SimReservation:
        res = self.reservations.get(sandbox_id)
        if res is None:
            raise not_found("reservation.not_found", f"no reservation for sandbox {sandbox_id!r}")
        return res

    def all(self) -> list[SimReservation]:
        with self.lock:
            return list(self.reservations.values())
