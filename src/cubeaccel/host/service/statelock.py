"""One process per state directory: an exclusive `flock` held for the process's lifetime.

Two Cubelets on one store would each reconcile the other's reservations away, and two CubeMasters on one SQLite
file would each run maintenance; both looked healthy. The lock is an advisory `flock` on `<dir>/<role>.lock`
(the kernel drops it when the holder exits, however it exits, so a crash never leaves a stale lock); the holder
writes its pid into the file so the refusal names it. Different roles may share a directory (`cubeaccel up`
keeps CubeMaster's database next to its own `up.lock`), so each role has its own lock file.
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

from cubeaccel.protocol.errors import CubeError

LOCKED_EXIT = 75  # EX_TEMPFAIL: the directory is busy, not broken; a unit with Restart=on-failure retries


@dataclass
class StateLock:
    path: Path
    fd: int

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the only descriptor drops the flock
            self.fd = -1


def holder(path: Path) -> int | None:
    """The pid written by the lock's holder (None when unreadable: a holder between open and write)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def acquire(state_dir: Path, role: str) -> StateLock:
    """Take `<state_dir>/<role>.lock` or raise `state.locked` naming the holder's pid; never blocks."""
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = state_dir / f"{role}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        pid = holder(path)
        who = f"pid {pid}" if pid is not None else "another process"
        raise CubeError(
            "state.locked",
            f"{state_dir} is in use by {who} (another {role}); stop it or pick another --state-dir",
            "api",
            {"state_dir": str(state_dir), "lock": str(path), "holder_pid": pid, "role": role},
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return StateLock(path, fd)
