"""The guest's serial console log: the one file a guest writes at will, kept under a cap (issue 30 #4).

The shim opens `console.log` with O_APPEND and QEMU's file chardev opens its fd set with `append=on` (QEMU
re-applies the open flags to the shared file description, so both are needed), so every write of the VMM goes to
the file's current end. A thread of the shim looks at the size every `CHECK_S` from the VMM's start until the
shim's teardown; past the cap it copies the newest `cap` bytes to `console.log.1` (replacing the previous one)
and truncates `console.log`, and QEMU's next write lands at offset 0. On disk: at most two caps plus what the
guest writes in one check interval. Not RLIMIT_FSIZE on the VMM: that would also cap the template states it
writes through a descriptor, and a guest reaching it would kill its own VMM with SIGXFSZ.

Limits: bytes written between the copy and the truncate are lost (the marker line says a rotation happened);
while the shim is dead (killed) nothing rotates — Cubelet kills the orphaned VMM (release rules, reconcile).
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

CONSOLE_LOG = "console.log"
CAP_ENV = "CUBEACCEL_CONSOLE_LOG_MAX_BYTES"
DEFAULT_CAP_BYTES = 1024 * 1024
MIN_CAP_BYTES = 4096
CHECK_S = 0.25


def cap_bytes(environ: dict[str, str] | None = None) -> int:
    """The operator's cap (`CUBEACCEL_CONSOLE_LOG_MAX_BYTES`), never below MIN_CAP_BYTES; default 1 MiB."""
    raw = (os.environ if environ is None else environ).get(CAP_ENV, "")
    try:
        return max(MIN_CAP_BYTES, int(raw)) if raw.strip() else DEFAULT_CAP_BYTES
    except ValueError:
        return DEFAULT_CAP_BYTES


def open_console(path: Path) -> int:
    """A fresh, owner-only console log for the VMM to inherit: appended to, so a truncate moves its writes."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC, 0o600)


def rotate_if_over(path: Path, cap: int) -> bool:
    """One look: past `cap`, the newest `cap` bytes go to `PATH.1` and PATH is emptied. True when it rotated."""
    try:
        size = path.stat().st_size
    except OSError:
        return False
    if size <= cap:
        return False
    old = path.with_name(path.name + ".1")
    tmp = path.with_name(path.name + ".1.tmp")
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        src.seek(max(0, size - cap))
        dst.write(src.read(cap))
    os.chmod(tmp, 0o600)
    os.replace(tmp, old)
    os.truncate(path, 0)
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        try:
            os.write(fd, f"\n[cubeaccel: console log over {cap} bytes: rotated; the tail is in {old.name}]\n".encode())
        finally:
            os.close(fd)
    return True


class ConsoleCap:
    """The rotation thread of one sandbox's console log: `start()` when the VMM runs, `stop()` at teardown."""

    def __init__(self, path: Path, cap: int | None = None, check_s: float = CHECK_S) -> None:
        self.path = path
        self.cap = cap_bytes() if cap is None else cap
        self.check_s = check_s
        self.rotations = 0
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="console-cap", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._done.wait(self.check_s):
            with contextlib.suppress(OSError):  # a full disk or a removed dir: look again next time
                self.rotations += rotate_if_over(self.path, self.cap)

    def stop(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        with contextlib.suppress(OSError):  # what the VMM wrote since the last look
            self.rotations += rotate_if_over(self.path, self.cap)
