"""The pinned-memory ledger: memory locked (or about to be) by this node's sandboxes against what it can lock.

Every reservation with `pin_memory` takes guest RAM plus the VMM's own locked memory (model/pinned_memory.py,
measured) from the node's lockable memory from the moment it is reserved until the reservation closes — which
is only after its VMM is proven gone, so memory a dying VMM still holds is never promised twice. A reservation
that would overdraw it is refused at layer `pinned_memory` before any device is touched.

The charge is `vmm_locked(...).node_mib` for the guest the shim will run on this host (its accelerator, its
CPUs for the preallocation pool, its backend), the same function and the same terms the shim's RLIMIT_MEMLOCK
comes from: a sandbox admitted here is never one whose VMM then cannot lock. On a VFIO node a guest's RAM is
pinned by the IOMMU driver even when the template does not ask for mem-lock, so it is charged all the same.

Lockable memory is `--pinnable-memory-mib` when configured; otherwise MemAvailable plus what this node's
started VMMs already locked (they are out of MemAvailable, and the ledger counts them itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cubeaccel.cubelet.store import Reservation, Tx
from cubeaccel.host.vmm.hypervisor import detect_accel, host_cpus, numa_nodes
from cubeaccel.host.vmm.meminfo import available_mib, memlock_limit_mib
from cubeaccel.model.pinned_memory import (
    QEMU_LOCKED_OVERHEAD_MIB,
    QEMU_LOCKED_PER_VCPU_MIB,
    TCG_CACHE_MIB,
    LockedGuest,
    LockedMemory,
    prealloc_threads,
    vmm_locked,
)
from cubeaccel.model.reservation_params import ReservationParams
from cubeaccel.protocol.errors import CubeError


@dataclass(frozen=True)
class VmmHost:
    """What about this host changes what a VMM locks."""

    tcg: bool
    cpus: int
    vfio: bool  # the node's devices are vfio-pci functions
    numa: bool = False  # more than one NUMA node

    @classmethod
    def here(cls, vfio: bool) -> VmmHost:
        return cls(detect_accel()[0] != "kvm", host_cpus(), vfio, len(numa_nodes()) > 1)


def locked_guest(params: ReservationParams, host: VmmHost) -> LockedGuest:
    """The guest a reservation's shim will run, in the shim's own terms (shim/qemu.py `locked_guest`)."""
    memory = params.memory_mib
    return LockedGuest(
        memory_mib=memory,
        vcpus=params.vcpus,
        mlock=params.pin_memory,
        vfio=host.vfio,
        tcg=host.tcg,
        prealloc_threads=prealloc_threads(memory, host.cpus),
        numa_host=host.numa,
    )


def locked(params: ReservationParams, host: VmmHost) -> LockedMemory:
    return vmm_locked(locked_guest(params, host))


@dataclass(frozen=True)
class Ledger:
    lockable_mib: int
    source: str  # configured | meminfo
    by_sandbox: dict[str, int] = field(default_factory=dict)
    per_vmm_limit_mib: int | None = None  # RLIMIT_MEMLOCK when VMMs lack CAP_IPC_LOCK
    vmm_overhead_mib: int = QEMU_LOCKED_OVERHEAD_MIB  # this node's, for CubeMaster's estimate

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
            "vmm_overhead_mib": self.vmm_overhead_mib,
            "vmm_overhead_per_vcpu_mib": QEMU_LOCKED_PER_VCPU_MIB,
            "sandboxes": dict(self.by_sandbox),
        }


def ledger(reservations: list[Reservation], configured_mib: int | None, host: VmmHost) -> Ledger:
    by_sandbox = {r.sandbox_id: n for r in reservations if (n := locked(r.params, host).node_mib)}
    overhead = QEMU_LOCKED_OVERHEAD_MIB + (TCG_CACHE_MIB if host.tcg else 0)
    if configured_mib is not None:
        return Ledger(configured_mib, "configured", by_sandbox, memlock_limit_mib(), overhead)
    started = sum(by_sandbox.get(r.sandbox_id, 0) for r in reservations if r.checkpoint.shim_started)
    return Ledger(available_mib() + started, "meminfo", by_sandbox, memlock_limit_mib(), overhead)


def admit(t: Tx, sandbox_id: str, params: ReservationParams, configured_mib: int | None, host: VmmHost) -> Ledger:
    """Inside `reserve`'s transaction, before any device moves: refuse what the node cannot lock."""
    led = ledger(t.reservations(), configured_mib, host)
    want = locked(params, host)
    need = want.node_mib
    if need == 0:
        return led
    details = {"requested_mib": need, "rlimit_mib": want.rlimit_mib, "guest_mib": params.memory_mib}
    details.update(led.to_json())
    if led.per_vmm_limit_mib is not None and want.rlimit_mib > led.per_vmm_limit_mib:
        raise CubeError(
            "reserve.pinned_memory_over_rlimit",
            f"sandbox {sandbox_id} must lock {want.rlimit_mib} MiB but a VMM may lock only "
            f"{led.per_vmm_limit_mib} MiB (RLIMIT_MEMLOCK, no CAP_IPC_LOCK)",
            "pinned_memory",
            details,
        )
    if need > led.free_mib:
        raise CubeError(
            "reserve.pinned_memory_exhausted",
            f"sandbox {sandbox_id} must lock {need} MiB (guest {params.memory_mib} MiB + VMM "
            f"overhead); {led.free_mib} of {led.lockable_mib} MiB lockable are free, {led.locked_mib} MiB "
            f"held by {len(led.by_sandbox)} sandbox(es)",
            "pinned_memory",
            details,
        )
    return led
