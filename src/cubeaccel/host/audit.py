"""An audit trail: append-only, fsync'd, hash-chained JSON lines (one file per CubeMaster replica, per Cubelet).

Each entry carries `prev` (the hash of the line before it; 64 zeros for the first) and `hash`, the sha256 of
its own canonical JSON without `hash`. Editing a line breaks its hash; removing or reordering one breaks the
next line's `prev`. Appends hold an exclusive `flock` on the file, so processes sharing a file keep one chain.
Truncating the tail is visible only against a copy of the last hash kept elsewhere (docs/security.md).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

GENESIS = "0" * 64


def _hash(entry: dict[str, Any]) -> str:
    body = {k: v for k, v in entry.items() if k != "hash"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _last_line(fd: int) -> bytes | None:
    size = os.lseek(fd, 0, os.SEEK_END)
    if size == 0:
        return None
    chunk = 4096
    pos, buf = size, b""
    while pos > 0:
        step = min(chunk, pos)
        pos -= step
        buf = os.pread(fd, step, pos) + buf
        lines = buf.rstrip(b"\n").split(b"\n")
        if len(lines) > 1 or pos == 0:
            return lines[-1]
    return None


class AuditLog:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.close(fd)
        self._lock = threading.Lock()

    def append(self, action: str, identity: str, outcome: str, **fields: Any) -> dict[str, Any]:
        with self._lock:
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                last = _last_line(fd)
                prev, seq = GENESIS, 0
                if last:
                    e = json.loads(last)
                    prev, seq = str(e["hash"]), int(e["seq"])
                entry: dict[str, Any] = {
                    "seq": seq + 1,
                    "at": time.time(),
                    "action": action,
                    "identity": identity,
                    "outcome": outcome,
                    **fields,
                    "prev": prev,
                }
                entry["hash"] = _hash(entry)
                os.write(fd, (json.dumps(entry, sort_keys=True, separators=(",", ":")) + "\n").encode())
                os.fsync(fd)
                return entry
            finally:
                os.close(fd)


def read(path: Path) -> Iterator[dict[str, Any]]:
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def verify(path: Path) -> list[str]:
    """Every break in the chain, as `line N: why`; empty when the file is intact."""
    problems: list[str] = []
    prev = GENESIS
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            try:
                e = json.loads(line)
            except ValueError:
                problems.append(f"line {n}: not JSON")
                prev = ""
                continue
            if e.get("prev") != prev:
                problems.append(f"line {n}: prev does not match the line before (a line removed or reordered)")
            if e.get("hash") != _hash(e):
                problems.append(f"line {n}: hash does not match its content (the line was edited)")
            prev = str(e.get("hash"))
    return problems
