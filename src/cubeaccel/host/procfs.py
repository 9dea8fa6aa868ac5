"""Holders: which processes hold a device file open, read from `/proc/<pid>/fd/*`.

The release path and reconciliation rely on this to prove that the VMM has really let go of a device
before it is reset and handed to the next tenant (ARCHITECTURE §5, step 6). It is read-only and takes
the proc root as a parameter, so tests run it against a fake tree and against the real `/proc`.

Processes come and go while we scan: a pid or fd that disappears, or that we may not read, is
skipped — the scan reports what it could see, and the caller decides what "could not see" means.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from cubeaccel.host.pci import Holder

Matcher = Callable[[str], bool]


def exact(paths: Iterable[str]) -> Matcher:
    """Match fd targets equal to one of `paths` (e.g. `/dev/vfio/12`)."""
    wanted = frozenset(paths)
    return wanted.__contains__


def glob(pattern: str) -> Matcher:
    """Match fd targets against a shell pattern (e.g. `/dev/nvidia*`)."""
    return lambda target: fnmatch.fnmatchcase(target, pattern)


def any_of(*matchers: Matcher) -> Matcher:
    return lambda target: any(m(target) for m in matchers)


def _command(pid_dir: Path) -> str:
    try:
        return (pid_dir / "comm").read_text(errors="replace").strip()
    except OSError:
        return "?"


def find_holders(match: Matcher, proc_root: str | os.PathLike[str] = "/proc") -> list[Holder]:
    """Every (pid, command, path) whose open fd points at a path `match` accepts. Sorted by pid, path."""
    root = Path(proc_root)
    try:
        entries = list(os.scandir(root))
    except OSError:
        return []
    found: set[Holder] = set()
    for entry in entries:
        if not entry.name.isdigit():
            continue
        pid_dir = root / entry.name
        try:
            fds = list(os.scandir(pid_dir / "fd"))
        except OSError:  # exited, or not ours to read
            continue
        for fd in fds:
            try:
                target = os.readlink(fd.path)
            except OSError:
                continue
            if match(target):
                found.add(Holder(pid=int(entry.name), command=_command(pid_dir), path=target))
    return sorted(found, key=lambda h: (h.pid, h.path))
