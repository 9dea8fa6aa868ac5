"""Rewrite this process's /proc/PID/cmdline in place: a forked shim must show the argv a spawned one has.

Cubelet finds a sandbox's shim by its argv in /proc (host/vmm/vmmproc.py `find_shim`), also after Cubelet restarts,
so a shim forked from the fork server has to look exactly like `python -m cubeaccel.shim run --sandbox ID
--spec PATH`. The kernel reads cmdline from the process's own argument area, [arg_start, arg_end) in
/proc/self/stat; we overwrite that memory with the new NUL-separated argv and NUL padding (the padding reads as
empty arguments, which every reader here drops). `prctl(PR_SET_MM)` could move the area instead, but needs
CAP_SYS_RESOURCE, which this project's hosts do not always grant. The area cannot grow, so the fork server is
started with a reserve argument (`room_args`) large enough for any shim argv.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

ROOM_FLAG = "--cmdline-room"
ROOM_BYTES = 8192  # a sandbox id and a spec path, several times over


def room_args(size: int = ROOM_BYTES) -> list[str]:
    """Arguments that reserve `size` bytes of argument area (dropped once the process rewrote its cmdline)."""
    return [ROOM_FLAG, "." * size]


def arg_area(stat: Path = Path("/proc/self/stat")) -> tuple[int, int]:
    """[arg_start, arg_end) of this process (fields 48 and 49 of stat, after the parenthesised comm)."""
    raw = stat.read_bytes()
    fields = raw[raw.rindex(b")") + 2 :].split()
    return int(fields[45]), int(fields[46])


def encode(argv: list[str]) -> bytes:
    if not argv or any(not a or "\0" in a for a in argv):
        raise ValueError("argv must be non-empty strings without NUL")
    return b"\0".join(a.encode() for a in argv) + b"\0"


def set_cmdline(argv: list[str]) -> None:
    """Make /proc/self/cmdline read `argv`; raises ValueError when it does not fit, OSError when the kernel
    shows something else afterwards (nothing is left half-written: the check reads it back)."""
    data = encode(argv)
    start, end = arg_area()
    if len(data) > end - start:
        raise ValueError(f"argv needs {len(data)} bytes, the argument area has {end - start}")
    ctypes.memmove(start, data.ljust(end - start, b"\0"), end - start)
    shown = [a for a in Path("/proc/self/cmdline").read_bytes().split(b"\0") if a]
    if shown != data.split(b"\0")[:-1]:
        raise OSError(f"cmdline reads {shown[:3]!r}... after the rewrite")
