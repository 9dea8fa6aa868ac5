"""What a real VMM locks against what the node's ledger charges for it (issue 30 #8), for tests and bench/.

A sandbox is reserved and started on an emulated Cubelet; from the moment its VMM exists until `settle_s` after
the guest was validated, its VmLck is read from /proc/PID/status and the peak kept; the ledger's charge is the
Cubelet's own (`GET /v1/host`, `pinned_memory.sandboxes`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from cubeaccel.shim.memory import status_kib
from tests.support.cubelet_process import CubeletProcess
from tests.support.poll import poll


@dataclass(frozen=True)
class LockedSample:
    memory_mib: int
    vcpus: int
    peak_vmlck_kib: int
    charge_mib: int

    @property
    def vmm_above_guest_mib(self) -> float:
        return self.peak_vmlck_kib / 1024 - self.memory_mib


def _validated(p: CubeletProcess, sid: str) -> bool:
    return any(e.kind == "guest_checked" for e in p.client.events(0, 10000, sandbox_id=sid).events)


def measure_locked(
    p: CubeletProcess, sid: str, contract: dict[str, Any], memory_mib: int, vcpus: int, settle_s: float = 5.0
) -> LockedSample:
    p.client.reserve(sid, 1, contract=contract, memory_mib=memory_mib, vcpus=vcpus, start=True)
    charge = p.client.host().pinned_memory.sandboxes[sid]
    pid = poll(lambda: p.vmm(sid), 120, what=f"{sid}'s VMM")
    peak, settled_at = 0, None
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        peak = max(peak, status_kib(pid).get("VmLck", 0))
        if settled_at is None and _validated(p, sid):
            settled_at = time.monotonic()
        if settled_at is not None and time.monotonic() - settled_at >= settle_s:
            break
        time.sleep(0.05)  # sampling rate of the measurement, not a wait for a condition
    assert settled_at is not None, f"{sid}'s guest was not validated within 300 s"
    return LockedSample(memory_mib, vcpus, peak, charge)
