"""AF_UNIX addresses for sockets whose full path may exceed the kernel's 108-byte limit.

A VMM's sockets live in its sandbox's directory under the state directory: with a 63-character sandbox id that
path passes 108 bytes for any state directory longer than ~24 characters. QEMU binds them by a name relative
to its working directory (that directory); clients reach them through `/proc/self/fd/<dirfd>/<name>`, which
the kernel resolves like any path, so neither side is bound by the directory's length.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

SUN_PATH_MAX = 107  # sizeof(sun_path) - 1 for the terminating NUL

_lock = threading.Lock()
_dir_fds: dict[str, int] = {}  # directory → an O_PATH fd kept open for the process's life


def connect_path(path: Path) -> str:
    """A path a client can connect to: `path` itself when short enough, else one through an O_PATH fd of its
    directory (opened once per directory; re-opened when the directory was replaced)."""
    text = str(path)
    if len(os.fsencode(text)) <= SUN_PATH_MAX:
        return text
    directory = str(path.parent)
    with _lock:
        fd = _dir_fds.get(directory)
        if fd is not None and not _same_dir(fd, directory):
            os.close(fd)
            fd = None
        if fd is None:
            fd = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            _dir_fds[directory] = fd
    short = f"/proc/self/fd/{fd}/{path.name}"
    if len(os.fsencode(short)) > SUN_PATH_MAX:
        raise ValueError(f"socket name too long for AF_UNIX even relative to its directory: {path.name!r}")
    return short


def _same_dir(fd: int, directory: str) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(directory)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
