"""Proof that guest memory is resident and locked, read from the VMM's /proc/PID/status.

`-overcommit mem-lock=on` is mlockall(): when it succeeds VmLck covers all guest RAM. The shim checks the number
instead of trusting the flag, because a VMM can start with a lower RLIMIT_MEMLOCK, without CAP_IPC_LOCK, or on a
kernel that refuses, and a device must never be attached to a guest whose memory can still move (DMA).
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

from cubeaccel.model.errors import CubeError

CAP_IPC_LOCK = 14


def status_kib(pid: int, proc_root: Path = Path("/proc")) -> dict[str, int]:
    """VmLck, VmRSS, VmSize, ... in KiB (empty when the process is gone)."""
    out: dict[str, int] = {}
    try:
        text = (proc_root / str(pid) / "status").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, value = line.partition(":")
        parts = value.split()
        if key.startswith("Vm") and len(parts) == 2 and parts[1] == "kB":
            out[key] = int(parts[0])
    return out


def memlock_hint() -> str:
    """Why locking may fail here, in the operator's terms."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    has_cap = False
    try:
        for line in Path(f"/proc/{os.getpid()}/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                has_cap = bool(int(line.split()[1], 16) >> CAP_IPC_LOCK & 1)
    except OSError:
        pass

    def fmt(v: int) -> str:
        return "unlimited" if v == resource.RLIM_INFINITY else f"{v // 1024} KiB"

    if has_cap:
        return "the VMM has CAP_IPC_LOCK, so the kernel refused the lock; check free memory and hugepage pools"
    return (
        f"RLIMIT_MEMLOCK is {fmt(soft)} (hard {fmt(hard)}) and CAP_IPC_LOCK is absent: raise LimitMEMLOCK "
        "(systemd) / `ulimit -l`, or grant cap_ipc_lock to the VMM"
    )


def pinned_error(code: str, message: str, **details: object) -> CubeError:
    return CubeError(code=code, message=message, layer="pinned_memory",
                     details={"hint": memlock_hint(), **details}, status=500)


def prove_pinned(pid: int, guest_mib: int, proc_root: Path = Path("/proc")) -> dict[str, int]:
    """Return {vmlck_kib, vmrss_kib, guest_kib} or raise `pinned_memory.not_locked`."""
    st = status_kib(pid, proc_root)
    guest_kib = guest_mib * 1024
    locked, rss = st.get("VmLck", 0), st.get("VmRSS", 0)
    if locked < guest_kib:
        raise pinned_error(
            "pinned_memory.not_locked",
            f"VMM {pid} has {locked} KiB locked, guest memory is {guest_kib} KiB",
            vmlck_kib=locked, vmrss_kib=rss, guest_kib=guest_kib,
        )
    return {"vmlck_kib": locked, "vmrss_kib": rss, "guest_kib": guest_kib}
