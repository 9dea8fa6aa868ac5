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

import asyncio
import fcntl
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import suppress
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


class _Pending:
    """One caller's entry, waiting for the batch that writes it; `woken` is called (on the writer thread)
    once it is written or has failed."""

    __slots__ = ("entry", "error", "fields", "woken")

    def __init__(self, fields: dict[str, Any], woken: Callable[[], None]) -> None:
        self.fields = fields
        self.entry: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self.woken = woken

    def result(self) -> dict[str, Any]:
        if self.error is not None:
            raise self.error
        assert self.entry is not None
        return self.entry


class AuditLog:
    """Appends are group-committed by one writer thread: what callers queue while a batch is on its way to
    disk is written by the next batch, with one flock, one write, one fsync and one head seal. Each caller
    returns only once its own line is on disk, as with one fsync per line. `append_async` is the same for
    the event loop, without a worker-thread hand-off per request."""

    def __init__(self, path: Path, head: Path | None = None, sealers: Sequence[Sealer] = ()) -> None:
        """`head`: where the head is sealed (default `<path>.head`); `sealers`: more places, called in order."""
        self.path = path
        self.head = head or head_path(path)
        self.sealers = list(sealers)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.close(fd)
        self._cv = threading.Condition(threading.Lock())
        self._queue: list[_Pending] = []
        self._writer: threading.Thread | None = None  # started by the first append
        self._log_id: str | None = None
        self.batches = 0  # fsync'd writes so far (the benchmark's lines per fsync)

    def append(self, action: str, identity: str, outcome: str, **fields: Any) -> dict[str, Any]:
        done = threading.Event()
        mine = self._enqueue(_fields(action, identity, outcome, fields), done.set)
        done.wait()
        return mine.result()

    def append_later(self, action: str, identity: str, outcome: str, **fields: Any) -> Callable[[], dict[str, Any]]:
        """Queue the entry and return at once; the returned call waits until it is on disk (and returns it). For
        callers that must not wait for the disk where they are (the Cubelet's lifecycle lock), but before replying."""
        done = threading.Event()
        mine = self._enqueue(_fields(action, identity, outcome, fields), done.set)

        def wait() -> dict[str, Any]:
            done.wait()
            return mine.result()

        return wait

    async def append_async(self, action: str, identity: str, outcome: str, **fields: Any) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            if not fut.done():
                fut.set_result(None)

        def woken() -> None:
            with suppress(RuntimeError):  # the loop is closed: nobody is left to tell
                loop.call_soon_threadsafe(wake)

        mine = self._enqueue(_fields(action, identity, outcome, fields), woken)
        await asyncio.shield(fut)  # a caller that goes away still has its line written
        return mine.result()

    def _enqueue(self, fields: dict[str, Any], woken: Callable[[], None]) -> _Pending:
        mine = _Pending(fields, woken)
        with self._cv:
            self._queue.append(mine)
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name="audit-writer", daemon=True)
                self._writer.start()
            self._cv.notify()
        return mine

    def _write_loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                batch, self._queue = self._queue, []
            try:
                self._write(batch)
            except BaseException as e:  # disk full, I/O error: every caller of the batch hears it
                for p in batch:
                    p.error = e
            for p in batch:
                p.woken()

    def _write(self, batch: list[_Pending]) -> None:
        """The batch's lines, chained after the file's last line (another process may have appended)."""
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # other processes sharing the file keep one chain
            last = _last_line(fd)
            prev, seq = GENESIS, 0
            if last:
                e = json.loads(last)
                prev, seq = str(e["hash"]), int(e["seq"])
            first: str | None = None  # the log's id, when this batch starts the log
            lines = []
            for p in batch:
                seq += 1
                entry: dict[str, Any] = {"seq": seq, **p.fields, "prev": prev, "sealed": True}
                entry["hash"] = prev = _hash(entry)
                first = first or (prev if seq == 1 else None)
                lines.append(json.dumps(entry, sort_keys=True, separators=(",", ":")) + "\n")
                p.entry = entry
            os.write(fd, "".join(lines).encode())
            os.fsync(fd)
            self.batches += 1
            if self._log_id is None:
                self._log_id = first or _first_hash(fd)
            log_id = str(self._log_id)
            write_head(self.head, log_id, seq, prev)  # under the flock: heads never go back
            for seal in self.sealers:
                seal(log_id, seq, prev)
        finally:
            os.close(fd)


def _fields(action: str, identity: str, outcome: str, fields: dict[str, Any]) -> dict[str, Any]:
    return {"at": time.time(), "action": action, "identity": identity, "outcome": outcome, **fields}


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
