"""How much memory one sandbox locks on its node: guest RAM plus the VMM's own locked memory.

Cubelet's ledger and CubeMaster's placement claims both use `sandbox_locked_mib`, so the two agree on what a
placement costs. The overhead figures travel in the heartbeat (`pinned_memory`), measured per VMM.

Measured here (QEMU 7.2, TCG `tb-size=64`, q35, `memory-backend-ram,prealloc=on`, `-overcommit mem-lock=on`,
virtio-serial and two root ports, the test image's kernel + initrd booting; peak of `/proc/PID/status` over 25 s):

| guest RAM | vCPUs | VmLck above guest | VmRSS above guest |
|---|---|---|---|
| 256 MiB | 1 | 387 MiB | 278 MiB |
| 1024 MiB | 1 | 387 MiB | 279 MiB |
| 256 MiB | 2 | 460 MiB | 297 MiB |
| 256 MiB (no mem-lock) | 1 | 0 | 210 MiB |

The overhead does not grow with guest RAM; each extra vCPU thread adds ~73 MiB of locked mappings (its stack
and TCG state). `mlockall()` counts every mapping, resident or not, against RLIMIT_MEMLOCK, so the ledger uses
VmLck (the larger, conservative figure), rounded up. Under KVM the TCG translation cache (64 MiB) is absent, so
these constants over-count a little on production hosts; re-measure there before tightening them.
"""

from __future__ import annotations

QEMU_LOCKED_OVERHEAD_MIB = 400  # VmLck above guest RAM, 1 vCPU (measured 387 MiB)
QEMU_LOCKED_PER_VCPU_MIB = 80  # each vCPU after the first (measured 73 MiB)


def sandbox_locked_mib(
    memory_mib: int,
    vcpus: int,
    pin_memory: bool,
    overhead_mib: int = QEMU_LOCKED_OVERHEAD_MIB,
    per_vcpu_mib: int = QEMU_LOCKED_PER_VCPU_MIB,
) -> int:
    """MiB a sandbox takes from its node's lockable memory; 0 when its memory is not pinned."""
    if not pin_memory:
        return 0
    return memory_mib + overhead_mib + per_vcpu_mib * max(0, vcpus - 1)
