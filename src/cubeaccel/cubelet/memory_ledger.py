"""The pinned-memory ledger: memory locked (or about to be) by this node's sandboxes against what it can lock.

Every reservation with `pin_memory` takes guest RAM plus the VMM's own locked memory (model/pinned_memory.py,
measured) from the node's lockable memory from the moment it is reserved until the reservation closes — which
is only after its VMM is proven gone, so memory a dying VMM still holds is never promised twice. A reservation
that would overdraw it is refused at layer `pinned_memory` before any device is touched.

Lockable memory is `--pinnable-memory-mib` when configured; otherwise MemAvailable plus what this node's
started VMMs already locked (they are out of MemAvailable, and the ledger counts them itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cubeaccel.cubelet.store import Reservation, Tx
from cubeaccel.host.meminfo import available_mib, memlock_limit_mib
from cubeaccel.model.errors import CubeError
from cubeaccel.model.pinned_memory import QEMU_LOCKED_OVERHEAD_MIB, QEMU_LOCKED_PER_VCPU_MIB, sandbox_locked_mib


def locked_mib(params: dict[str, Any]) -> int:
    return sandbox_locked_mib(int(params["memory_mib"]), int(params.get("vcpus", 1)), bool(params["pin_memory"]))


@dataclass(frozen=True)
class Ledger:
    lockable_mib: int
    source: str  # configured | meminfo
    by_sandbox: dict[str, int] = field(default_factory=dict)
    per_vmm_limit_mib: int | None = None  # RLIMIT_MEMLOCK when VMMs lack CAP_IPC_LOCK

    @property
    def locked_mib(self) -> int:
        return sum(self.by_sandbox.values())

    @property
    def free_mib(self) -> int:
        return max(0, self.lockable_mib - self.locked_mib)

    def to_json(self) -> dict[str, Any]:
        return {
            "lockable_mib": self.lockable_mib,
            "locked_mib": self.locked_mib,
            "free_mib": self.free_mib,
            "source": self.source,
            "per_vmm_limit_mib": self.per_vmm_limit_mib,
            "vmm_overhead_mib": QEMU_LOCKED_OVERHEAD_MIB,
            "vmm_overhead_per_vcpu_mib": QEMU_LOCKED_PER_VCPU_MIB,
            "sandboxes": dict(self.by_sandbox),
        }


def ledger(reservations: list[Reservation], configured_mib: int | None) -> Ledger:
    by_sandbox = {r.sandbox_id: n for r in reservations if (n := locked_mib(r.params))}
    if configured_mib is not None:
        return Ledger(configured_mib, "configured", by_sandbox, memlock_limit_mib())
    started = sum(by_sandbox.get(r.sandbox_id, 0) for r in reservations if r.checkpoint.shim_started)
    return Ledger(available_mib() + started, "meminfo", by_sandbox, memlock_limit_mib())


def admit(t: Tx, sandbox_id: str, params: dict[str, Any], configured_mib: int | None) -> Ledger:
    """Inside `reserve`'s transaction, before any device moves: refuse what the node cannot lock."""
    led = ledger(t.reservations(), configured_mib)
    need = locked_mib(params)
    if need == 0:
        return led
    details = {"requested_mib": need, "guest_mib": int(params["memory_mib"]), **led.to_json()}
    if led.per_vmm_limit_mib is not None and need > led.per_vmm_limit_mib:
        raise CubeError(
            "reserve.pinned_memory_over_rlimit",
            f"sandbox {sandbox_id} must lock {need} MiB but a VMM may lock only "
            f"{led.per_vmm_limit_mib} MiB (RLIMIT_MEMLOCK, no CAP_IPC_LOCK)",
            "pinned_memory",
            details,
            409,
        )
    if need > led.free_mib:
        raise CubeError(
            "reserve.pinned_memory_exhausted",
            f"sandbox {sandbox_id} must lock {need} MiB (guest {params['memory_mib']} MiB + VMM "
            f"overhead); {led.free_mib} of {led.lockable_mib} MiB lockable are free, {led.locked_mib} MiB "
            f"held by {len(led.by_sandbox)} sandbox(es)",
            "pinned_memory",
            details,
            409,
        )
    return led
