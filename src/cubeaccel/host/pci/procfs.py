"""Holders: which processes hold a device file open, read from `/proc/<pid>/fd/*`.

The release path and reconciliation rely on this to prove that the VMM has really let go of a device
before it is reset and handed to the next tenant (ARCHITECTURE §5, step 6). It is read-only and takes
the proc root as a parameter, so tests run it against a fake tree and against the real `/proc`.

Processes come and go while we scan: a pid or fd that disappears is skipped (it holds nothing any more).
A process whose fds exist but cannot be read (EACCES, an LSM, another user namespace) may hold the device:
it is reported as an `unknown` holder, so the release path waits and then quarantines (fail closed).
An unreadable proc root is one unknown holder with pid 0.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from cubeaccel.host.pci.base import Holder

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


UNREADABLE = "?unreadable"  # the path of an unknown holder


def _gone(e: OSError) -> bool:
    """The process or fd went away while we looked (ESRCH, ENOENT): it holds nothing."""
    return isinstance(e, (FileNotFoundError, ProcessLookupError))


def find_holders(match: Matcher, proc_root: str | os.PathLike[str] = "/proc") -> list[Holder]:
    """Every (pid, command, path) whose open fd points at a path `match` accepts, plus every process whose
    fds could not be read (`unknown=True`). Sorted by pid, path."""
    root = Path(proc_root)
    try:
        entries = list(os.scandir(root))
    except OSError:
        return [Holder(pid=0, command="?", path=f"{root}: unreadable", unknown=True)]
    found: set[Holder] = set()
    for entry in entries:
        if not entry.name.isdigit():
            continue
        pid_dir = root / entry.name
        try:
            fds = list(os.scandir(pid_dir / "fd"))
        except OSError as e:
            if not _gone(e):
                found.add(Holder(int(entry.name), _command(pid_dir), UNREADABLE, unknown=True))
            continue
        for fd in fds:
            try:
                target = os.readlink(fd.path)
            except OSError as e:
                if not _gone(e):
                    found.add(Holder(int(entry.name), _command(pid_dir), UNREADABLE, unknown=True))
                continue
            if match(target):
                found.add(Holder(pid=int(entry.name), command=_command(pid_dir), path=target))
    return sorted(found, key=lambda h: (h.pid, h.path))


def start_time(pid: int, proc_root: str | os.PathLike[str] = "/proc") -> int | None:
    """The process's start time (clock ticks after boot, /proc/PID/stat field 22), or None when it is gone.
    With the pid it names one process: a pid reused by another process has another start time."""
    try:
        raw = (Path(proc_root) / str(pid) / "stat").read_bytes()
    except OSError:
        return None
    fields = raw.rsplit(b")", 1)[-1].split()
    try:
        return int(fields[19]) if fields[0] not in (b"Z", b"X") else None
    except (IndexError, ValueError):
        return None
