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
