"""How long a MicroVM's start may take, from the size of its guest.

Every page of guest RAM is touched before QEMU answers its first QMP command (`prealloc=on`), so a fixed
deadline either fails large guests or waits far too long for a dead small one. Measured here: ~2.3 s/GiB on
memory the host has returned (a fresh machine), 0.05-0.1 s/GiB warm (docs/benchmarks.md); the deadlines take
the cold figure with half again as margin, and do not count on extra preallocation threads (on a host VM
the page faults, not the CPUs, are the limit).
"""

from __future__ import annotations

from dataclasses import dataclass

BASE_S = 60.0  # a small guest: spawn to QMP, boot to agent, restore (what the fixed deadlines were)
PREALLOC_COLD_S_PER_GIB = 2.3
MARGIN = 1.5
GUEST_INIT_S_PER_GIB = 0.5  # the guest kernel initialises its memory map (TCG is slowest)
MIGRATE_S_PER_GIB = 1.0  # template save/restore scans every page (zero pages are cheap, not free)
# The guest kernel copies the initrd and unpacks it into its RAM before init runs: the NVIDIA image's 246 MB
# initrd (driver, libcuda, firmware) against the CPU image's 57 MB. Under TCG on a loaded 2-core host its
# boot-to-agent was 60+ s (docs/benchmarks.md "GPU image boot"); this allows ~4 MiB/s of unpacking on top.
INITRD_S_PER_MIB = 0.25


@dataclass(frozen=True)
class StartDeadlines:
    vmm_ready_s: float  # spawn → QMP greeting (preallocation happens in between)
    guest_ready_s: float  # QMP → the guest agent's hello
    migrate_s: float  # template state written, or read back until the VM is paused


def start_deadlines(memory_mib: int, base_s: float = BASE_S, initrd_bytes: int = 0) -> StartDeadlines:
    """`base_s`: the allowance for a small guest (the spec's `boot_timeout_s`); `initrd_bytes`: the image's
    initrd, which a cold boot unpacks before the agent can answer (a restore skips it: the template has it)."""
    gib = max(0.0, memory_mib / 1024)
    initrd_mib = max(0, initrd_bytes) / (1 << 20)
    return StartDeadlines(
        vmm_ready_s=round(base_s + gib * PREALLOC_COLD_S_PER_GIB * MARGIN, 1),
        guest_ready_s=round(base_s + gib * GUEST_INIT_S_PER_GIB + initrd_mib * INITRD_S_PER_MIB, 1),
        migrate_s=round(base_s + gib * MIGRATE_S_PER_GIB, 1),
    )


def startup_timeout_s(memory_mib: int, configured_s: float) -> float:
    """Cubelet's bound on a shim that has not yet reported its VMM started: never under the shim's own deadline
    for preallocation, so Cubelet does not tear down a large guest that is still being touched."""
    return max(configured_s, start_deadlines(memory_mib).vmm_ready_s + 30.0)
