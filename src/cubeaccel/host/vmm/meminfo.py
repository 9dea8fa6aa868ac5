"""How much guest memory this host could allocate and lock right now."""

from __future__ import annotations

from pathlib import Path


def available_mib(meminfo: Path = Path("/proc/meminfo")) -> int:
    """MemAvailable in MiB (root has CAP_IPC_LOCK, so what is available is what can be locked); 0 if unreadable."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


CAP_IPC_LOCK = 14


def memlock_limit_mib(status: Path = Path("/proc/self/status")) -> int | None:
    """The most one child VMM may lock: RLIMIT_MEMLOCK, unless this process has CAP_IPC_LOCK (then None:
    only free memory limits it). VMMs inherit both from Cubelet through the shim."""
    import resource

    try:
        for line in status.read_text().splitlines():
            if line.startswith("CapEff:") and int(line.split()[1], 16) >> CAP_IPC_LOCK & 1:
                return None
    except (OSError, ValueError, IndexError):
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft // (1 << 20)
