"""A deterministic `newc` cpio writer (the initramfs format Linux unpacks).

Written in Python rather than shelling out to `cpio` so the archive is byte-for-byte reproducible (mtime 0, uid 0,
sorted entries, modes normalized): the image digest in a template's contract must not change when nothing else did.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import BinaryIO

_TRAILER = "TRAILER!!!"


def _pad(n: int) -> bytes:
    return b"\0" * ((4 - n % 4) % 4)


def _header(out: BinaryIO, name: str, mode: int, size: int, ino: int, nlink: int = 1) -> None:
    fields = [ino, mode, 0, 0, nlink, 0, size, 0, 0, 0, 0, len(name) + 1, 0]
    head = b"070701" + b"".join(f"{f:08X}".encode() for f in fields)
    data = head + name.encode() + b"\0"
    out.write(data + _pad(len(data)))


def _perm(mode: int) -> int:
    """Modes as a umask-free build would give them: the builder's umask (0077 under a Cubelet, 0022 in a
    shell) must not change the archive. Directories and executables 0755, other files 0644."""
    if stat.S_ISDIR(mode) or mode & 0o111:
        return 0o755
    return 0o644


def write_tree(root: Path, out: BinaryIO, prefix: str = "", modes: Mapping[str, int] | None = None) -> int:
    """Write every file, directory and symlink under `root` (sorted) as a newc archive; returns entry count.

    `prefix` is prepended to member names, so a tree can be placed at e.g. `lib/modules/<kver>`.
    Hard links are stored as separate copies (simple and correct for an initramfs). `modes` gives the
    permission bits of named members (`usr/bin/sudo`: setuid) instead of the normalized ones.
    """
    ino = 1
    entries: list[tuple[str, Path]] = []
    if prefix:
        parts = prefix.strip("/").split("/")
        for i in range(1, len(parts) + 1):
            entries.append(("/".join(parts[:i]), Path()))
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, root)
        for name in sorted(dirnames + filenames):
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            entries.append(((f"{prefix.strip('/')}/{rel}" if prefix else rel), root / rel))
    for name, path in entries:
        if path == Path():
            _header(out, name, stat.S_IFDIR | 0o755, 0, ino, 2)
        else:
            st = path.lstat()
            perm = modes[name] if modes and name in modes else _perm(st.st_mode)
            if stat.S_ISLNK(st.st_mode):
                target = os.readlink(path).encode()
                _header(out, name, stat.S_IFLNK | 0o777, len(target), ino)
                out.write(target + _pad(len(target)))
            elif stat.S_ISDIR(st.st_mode):
                _header(out, name, stat.S_IFDIR | perm, 0, ino, 2)
            elif stat.S_ISREG(st.st_mode):
                data = path.read_bytes()
                _header(out, name, stat.S_IFREG | perm, len(data), ino)
                out.write(data + _pad(len(data)))
        ino += 1
    _header(out, _TRAILER, 0, 0, 0)
    return len(entries)
