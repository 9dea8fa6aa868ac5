"""Proof that guest memory is resident and locked, read from the VMM's /proc/PID/status.

`-overcommit mem-lock=on` is mlockall(): when it succeeds VmLck covers all guest RAM. The shim checks the number
instead of trusting the flag, because a VMM can start with a lower RLIMIT_MEMLOCK, without CAP_IPC_LOCK, or on a
kernel that refuses, and a device must never be attached to a guest whose memory can still move (DMA).
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

from cubeaccel.protocol.errors import CubeError

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
    return CubeError(
        code=code, message=message, layer="pinned_memory", details={"hint": memlock_hint(), **details}, status=500
    )


def guest_ram_locked_kib(pid: int, guest_kib: int, proc_root: Path = Path("/proc")) -> int | None:
    """Locked KiB of the mapping that *is* the guest's RAM (the backend object: a mapping of exactly the
    guest's size), read from smaps; None when no such mapping exists. Hugetlb pages cannot be swapped and
    the kernel does not count them as Locked, so a huge-page mapping of the right size counts as locked."""
    try:
        text = (proc_root / str(pid) / "smaps").read_text()
    except OSError:
        return None
    best: int | None = None
    size = locked = page = 0
    for line in [*text.splitlines(), "00000000-00000000 end"]:
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and head.replace("-", "").isalnum() and ":" not in head:
            if size == guest_kib:
                best = max(best or 0, size if page > 4 else locked)
            size = locked = page = 0
            continue
        key, _, rest = line.partition(":")
        value = rest.split()[0] if rest.split() else "0"
        if key == "Size" and value.isdigit():
            size = int(value)
        elif key == "Locked" and value.isdigit():
            locked = int(value)
        elif key == "KernelPageSize" and value.isdigit():
            page = int(value)
    return best


def prove_pinned(pid: int, guest_mib: int, proc_root: Path = Path("/proc")) -> dict[str, int]:
    """Return {vmlck_kib, vmrss_kib, guest_kib, guest_ram_locked_kib} or raise `pinned_memory.not_locked`.

    VmLck alone also counts QEMU's own locked memory (the TCG cache, libraries), so the guest RAM mapping
    itself must be fully locked too."""
    st = status_kib(pid, proc_root)
    guest_kib = guest_mib * 1024
    locked, rss = st.get("VmLck", 0), st.get("VmRSS", 0)
    ram = guest_ram_locked_kib(pid, guest_kib, proc_root)
    if locked < guest_kib or ram is None or ram < guest_kib:
        raise pinned_error(
            "pinned_memory.not_locked",
            f"VMM {pid}: guest RAM mapping has {ram if ram is not None else 'no'} KiB locked of {guest_kib} KiB "
            f"(VmLck {locked} KiB)",
            vmlck_kib=locked,
            vmrss_kib=rss,
            guest_kib=guest_kib,
            guest_ram_locked_kib=ram or 0,
        )
    return {"vmlck_kib": locked, "vmrss_kib": rss, "guest_kib": guest_kib, "guest_ram_locked_kib": ram}
