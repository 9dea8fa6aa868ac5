"""How much memory one sandbox locks on its node: guest RAM plus the VMM's own locked memory.

One function, `vmm_locked`, says it for every caller: the shim raises a confined VMM's RLIMIT_MEMLOCK to its
`rlimit_mib` (host/vmm/confine.py), Cubelet's ledger charges its `node_mib` and refuses a sandbox whose `rlimit_mib`
is over the limit a VMM gets, and CubeMaster's placement claims use `sandbox_locked_mib` with the node's figures
from the heartbeat. A term left out of one of them used to let a VMM start that then could not lock its memory.

Measured here (QEMU 7.2, TCG `tb-size=64`, q35, `memory-backend-ram,prealloc=on`, `-overcommit mem-lock=on`,
virtio-serial and two root ports, the test image's kernel + initrd booting; peak of `/proc/PID/status` over 25 s):

| guest RAM | vCPUs | VmLck above guest | VmRSS above guest |
|---|---|---|---|
| 256 MiB | 1 | 387 MiB | 278 MiB |
| 1024 MiB | 1 | 387 MiB | 279 MiB |
| 256 MiB | 2 | 460 MiB | 297 MiB |
| 256 MiB (no mem-lock) | 1 | 0 | 210 MiB |
| 1024 MiB, no guest (`-S`), `prealloc-threads=1` | 1 | 277 MiB | |
| the same, `prealloc-threads=2` / `4` / `8` | 1 | 345 / 350 / 350 MiB | |
| the same, 4 threads in a `thread-context` | 1 | 422 MiB | |

Measured again on the confined VMM a sandbox really runs (issue 30 #8; `bench/vmm_locked_bench.py`: an emulated
Cubelet's shim, seccomp and its own uid, the workload and agent ports, the console cap; peak from the VMM's start
until 5 s after the guest was validated; 3 runs per shape, TCG, docs/benchmarks.md):

| guest RAM | vCPUs | VmLck above guest (min / median / max) | charged before |
|---|---|---|---|
| 256 MiB | 1 | 554 / 554 / 554 MiB | 464 MiB |
| 256 MiB | 2 | 626 / 627 / 754 MiB | 544 MiB |

So the confined VMM's own locked memory is 490 MiB without the TCG cache (554 - 64), and a second vCPU adds 73 MiB
in two runs of three and 200 MiB in the third: glibc gives a thread that allocates its own malloc arena, a 64 MiB
mapping that mlockall counts whole, and how many threads get one varies run to run. The margin is that unit: one
arena (64 MiB) above the measured base, and one arena per vCPU above the measured 73 MiB (rounded up to 8 MiB).

The overhead does not grow with guest RAM; each extra vCPU thread adds ~73 MiB of locked mappings (its stack
and TCG state). A preallocation pool of any size adds ~70 MiB once, and it stays locked after the pool is gone
(glibc keeps the threads' stacks and arenas); a thread context (NUMA-local preallocation) adds ~72 MiB more.
`mlockall()` counts every mapping, resident or not, against RLIMIT_MEMLOCK, so the figures use VmLck (the
larger, conservative figure), rounded up. Under KVM the 64 MiB TCG translation cache is absent.

With VFIO and mem-lock the kernel charges guest RAM to locked_vm twice (type1 pinning and mlock), so the limit
must allow it twice, though the node loses it once.
"""

from __future__ import annotations

from dataclasses import dataclass

MALLOC_ARENA_MIB = 64  # the margin's unit: one glibc arena, which a VMM thread may or may not get
QEMU_LOCKED_OVERHEAD_MIB = 490 + MALLOC_ARENA_MIB + 6  # confined VMM, 1 vCPU, no TCG cache (measured 554 - 64)
QEMU_LOCKED_PER_VCPU_MIB = 73 + MALLOC_ARENA_MIB + 7  # each vCPU after the first (measured 73 MiB, or 200 with arenas)
TCG_CACHE_MIB = 64  # `-accel tcg,tb-size=64`: the translation cache is locked too
PREALLOC_POOL_MIB = 80  # a pool of 2..8 preallocation threads (measured 68-73 MiB, not per thread)
THREAD_CONTEXT_MIB = 80  # the thread context that keeps the pool on the devices' NUMA node (measured 72 MiB)
MAX_PREALLOC_THREADS = 8  # the pool sizes measured; more threads than that is unmeasured
PREALLOC_GIB_PER_THREAD = 1  # a guest under 2 GiB is faster to touch alone than to pay for a pool


def prealloc_threads(memory_mib: int, host_cpus: int) -> int:
    """How many threads touch a guest's memory at start: one per GiB, at most one per host CPU and 8."""
    return max(1, min(MAX_PREALLOC_THREADS, host_cpus, memory_mib // (PREALLOC_GIB_PER_THREAD * 1024)))


@dataclass(frozen=True)
class LockedGuest:
    """What shapes a VMM's locked memory. The shim builds it from its machine, Cubelet from a reservation."""

    memory_mib: int
    vcpus: int = 1
    mlock: bool = True  # `-overcommit mem-lock=on`: mlockall, so QEMU's own mappings are locked too
    vfio: bool = False  # a vfio-pci device: type1 pins guest RAM, mem-lock or not
    tcg: bool = False
    prealloc_threads: int = 1
    # A host with NUMA: the preallocation pool may run in a thread context on the devices' node. Counted whether or
    # not this guest's devices share one, so Cubelet (before it chose them) and the shim charge the same.
    numa_host: bool = False


@dataclass(frozen=True)
class LockedMemory:
    guest_mib: int  # guest RAM, locked once
    vmm_mib: int  # QEMU's own: libraries, arenas, thread stacks, the TCG cache
    recount_mib: int  # charged to locked_vm a second time (VFIO + mlock), not memory the node loses

    @property
    def node_mib(self) -> int:
        """What the node's lockable memory loses: the ledger's charge."""
        return self.guest_mib + self.vmm_mib

    @property
    def rlimit_mib(self) -> int:
        """What RLIMIT_MEMLOCK must allow the VMM, so that neither mlockall nor VFIO's pinning is refused."""
        return self.node_mib + self.recount_mib


def vmm_locked(
    g: LockedGuest, overhead_mib: int = QEMU_LOCKED_OVERHEAD_MIB, per_vcpu_mib: int = QEMU_LOCKED_PER_VCPU_MIB
) -> LockedMemory:
    """The one computation of what a VMM locks; `overhead_mib`/`per_vcpu_mib` are a node's own measured figures."""
    if not g.mlock:  # nothing but what VFIO pins
        return LockedMemory(g.memory_mib if g.vfio else 0, 0, 0)
    vmm = overhead_mib + per_vcpu_mib * max(0, g.vcpus - 1)
    vmm += TCG_CACHE_MIB if g.tcg else 0
    vmm += PREALLOC_POOL_MIB if g.prealloc_threads > 1 else 0
    vmm += THREAD_CONTEXT_MIB if g.numa_host else 0
    return LockedMemory(g.memory_mib, vmm, g.memory_mib if g.vfio else 0)


def sandbox_locked_mib(
    memory_mib: int,
    vcpus: int,
    pin_memory: bool,
    overhead_mib: int = QEMU_LOCKED_OVERHEAD_MIB,
    per_vcpu_mib: int = QEMU_LOCKED_PER_VCPU_MIB,
) -> int:
    """CubeMaster's estimate with a node's heartbeat figures (its `overhead_mib` includes its TCG cache);
    0 when the memory is not pinned. Cubelet's ledger, which knows the node, is exact and corrects it."""
    if not pin_memory:
        return 0
    return vmm_locked(LockedGuest(memory_mib, vcpus), overhead_mib, per_vcpu_mib).node_mib


def numa_bind_node(device_nodes: tuple[int | None, ...], host_nodes: tuple[int, ...]) -> int | None:
    """The host NUMA node to hold a guest's memory and its preallocation: the one node all its devices sit on,
    when the host has more than one (on one node there is nothing to choose; across nodes no one is local)."""
    if len(host_nodes) < 2 or len(set(device_nodes)) != 1:
        return None
    node = device_nodes[0]
    return node if node is not None and node in host_nodes else None
