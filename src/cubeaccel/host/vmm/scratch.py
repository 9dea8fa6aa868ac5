"""The workload's writable disk: a sparse ext4 image of exactly the template's size, in the sandbox's state dir.

Sparse, so the host pays only for what the guest wrote, and never more than the cap (the file cannot grow: QEMU
serves a fixed-size raw disk). `-m 0`: no blocks reserved for root, so the workload's ENOSPC comes at the cap.
Inode tables and journal are left unwritten (`lazy_*_init`, and the guest mounts with `noinit_itable`): a fresh
sparse file reads as zeros, so a 20 GiB disk costs the host ~4 MiB until the workload writes. It lives and dies
with the state dir; the release path removes it even when the shim did not.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from cubeaccel.host.service.childenv import tool_env
from cubeaccel.protocol.errors import CubeError

SCRATCH_FILE = "scratch.img"


def create_scratch(path: Path, size_mib: int) -> None:
    tmp = path.with_suffix(".partial")
    tmp.unlink(missing_ok=True)
    with tmp.open("wb") as f:
        f.truncate(size_mib * 1024 * 1024)
    argv = [
        "mkfs.ext4",
        "-q",
        "-F",
        "-m",
        "0",
        "-L",
        "cube-scratch",
        "-E",
        "lazy_itable_init=1,lazy_journal_init=1,nodiscard",
        str(tmp),
    ]
    try:
        p = subprocess.run(argv, env=tool_env(), capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        tmp.unlink(missing_ok=True)
        raise CubeError("filesystem.scratch_failed", f"mkfs.ext4: {e}", "backend", {}, 500) from e
    if p.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise CubeError("filesystem.scratch_failed", f"mkfs.ext4: {p.stderr.strip()[-300:]}", "backend", {}, 500)
    tmp.replace(path)


def remove_scratch(state_dir: Path) -> bool:
    """True when a scratch disk (or a half-made one) was there."""
    found = False
    for name in (SCRATCH_FILE, SCRATCH_FILE.replace(".img", ".partial")):
        p = state_dir / name
        if p.exists():
            p.unlink()
            found = True
    return found
