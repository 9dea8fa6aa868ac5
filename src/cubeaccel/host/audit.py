"""An audit trail: append-only, fsync'd, hash-chained JSON lines (one file per CubeMaster replica, per Cubelet).

Each entry carries `seq`, `prev` (the hash of the line before it; 64 zeros for the first) and `hash`, the
sha256 of its own canonical JSON without `hash`. Editing a line breaks its hash; removing or reordering one
breaks the next line's `prev`. Appends hold an exclusive `flock` on the file, so processes sharing a file keep
one chain.

A chain cannot show that its last lines were cut off, so every append also *seals* the head: `seq` and `hash`
of the newest entry go to a head file (`<log>.head` unless told otherwise; put it on other storage for it to
mean more) and to any other sealer (CubeMaster keeps one per log in its database). Entries say `sealed`, so
a log whose head file went missing is caught too. What this does not stop is someone able to write both the
log and every seal, who can rewrite the whole chain (docs/security.md).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

GENESIS = "0" * 64
Sealer = Callable[[str, int, str], None]  # (log id: the first entry's hash, seq, hash) after every append


def head_path(path: Path) -> Path:
    return path.with_name(path.name + ".head")


HEAD_BYTES = 256  # one record, rewritten in place at offset 0: within one sector, so never torn


def write_head(path: Path, log_id: str, seq: int, digest: str) -> None:
    """Overwrite the head record in place, without fsync: the entry itself was fsync'd first, so a head lost
    in a crash is only behind (accepted), never ahead of the log, and a sector-sized write is not torn."""
    record = json.dumps({"log": log_id, "seq": seq, "hash": digest}).encode().ljust(HEAD_BYTES)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.pwrite(fd, record, 0)
    finally:
        os.close(fd)


def _first_hash(fd: int) -> str | None:
    line = os.pread(fd, 65536, 0).split(b"\n", 1)[0]
    return str(json.loads(line)["hash"]) if line.strip() else None


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
    def __init__(self, path: Path, head: Path | None = None, sealers: Sequence[Sealer] = ()) -> None:
        """`head`: where the head is sealed (default `<path>.head`); `sealers`: more places, called in order."""
        self.path = path
        self.head = head or head_path(path)
        self.sealers = list(sealers)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.close(fd)
        self._lock = threading.Lock()
        self._log_id: str | None = None

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
                    "sealed": True,
                }
                entry["hash"] = _hash(entry)
                os.write(fd, (json.dumps(entry, sort_keys=True, separators=(",", ":")) + "\n").encode())
                os.fsync(fd)
                if self._log_id is None:
                    self._log_id = entry["hash"] if seq == 0 else _first_hash(fd)
                log_id = str(self._log_id)
                write_head(self.head, log_id, entry["seq"], entry["hash"])  # under the flock: heads never go back
                for seal in self.sealers:
                    seal(log_id, entry["seq"], entry["hash"])
                return entry
            finally:
                os.close(fd)


def read(path: Path) -> Iterator[dict[str, Any]]:
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def read_head(path: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads(path.read_bytes().strip() or b"null") or {}) or None
    except FileNotFoundError:
        return None


def log_id(path: Path) -> str | None:
    """The log's identity, as sealers know it: its first entry's hash."""
    with open(path, "rb") as f:
        line = f.readline()
    return str(json.loads(line)["hash"]) if line.strip() else None


def verify(path: Path, head: Path | None = None, seals: Sequence[dict[str, Any]] = ()) -> list[str]:
    """Every break in the chain, as `line N: why`, and every disagreement with the head file (`head`, default
    `<path>.head`) and the other `seals` ({"seq", "hash"} each); empty when the file is intact."""
    problems: list[str] = []
    head = head or head_path(path)
    found = read_head(head)
    checks = ([("head file", found)] if found else []) + [("seal", s) for s in seals]
    wanted = {int(seal["seq"]) for _, seal in checks}
    prev, last_seq, sealed = GENESIS, 0, False
    hashes: dict[int, str] = {}  # only at the sealed seqs
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
            if e.get("seq") != last_seq + 1:
                problems.append(f"line {n}: seq {e.get('seq')} after {last_seq} (lines missing or reordered)")
            prev, last_seq, sealed = str(e.get("hash")), int(e.get("seq") or 0), sealed or e.get("sealed") is True
            if last_seq in wanted:
                hashes[last_seq] = prev
    if found is None and sealed:
        problems.append(f"head: the log is sealed but its head file {head} is missing (removed with its tail?)")
    for where, seal in checks:
        seq, digest = int(seal["seq"]), str(seal["hash"])
        if seq > last_seq:
            problems.append(
                f"{where}: seq {seq} was sealed but the log ends at seq {last_seq} (its last {seq - last_seq} "
                "entries were cut off)"
            )
        elif hashes.get(seq) != digest:
            problems.append(f"{where}: seq {seq} does not have the sealed hash (the log was rewritten)")
    return problems
