"""Per-key locks: host work on one device (reset, holder scans, revalidation) must not wait for another's.

Order, where several are taken: a sandbox's key before its devices' keys, and the lifecycle lock last and only
around a short transaction — never the lifecycle lock while host I/O runs.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager


class KeyedLocks:
    """One reentrant lock per key (a device id, or `sandbox:<id>`), dropped when nobody holds or waits for it,
    so sandbox ids that come and go leave nothing behind."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[str, tuple[threading.RLock, int]] = {}

    @contextmanager
    def hold(self, key: str) -> Iterator[None]:
        with self._guard:
            lock, users = self._locks.get(key, (None, 0))
            if lock is None:
                lock = threading.RLock()
            self._locks[key] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._guard:
                _, users = self._locks[key]
                if users <= 1:
                    del self._locks[key]
                else:
                    self._locks[key] = (lock, users - 1)


class FairRLock:
    """A reentrant lock handed to its waiters in arrival order. `threading.RLock` lets whichever thread
    the scheduler wakes first win, so with a busy node's worth of requests queued one of them can lose
    many rounds in a row — the latency tail. Here the releasing owner hands the lock straight to the
    longest waiter."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._owner: int | None = None
        self._depth = 0
        self._waiters: deque[tuple[int, threading.Lock]] = deque()

    def acquire(self) -> bool:
        me = threading.get_ident()
        with self._guard:
            if self._owner == me:
                self._depth += 1
                return True
            if self._owner is None:
                self._owner, self._depth = me, 1
                return True
            gate = threading.Lock()
            gate.acquire()
            self._waiters.append((me, gate))
        try:
            gate.acquire()  # released by the owner that handed the lock to this thread
        except BaseException:  # interrupted (Ctrl-C in a CLI): leave the queue, or pass on what was handed over
            with self._guard:
                handed = self._owner == me
                if not handed:
                    self._waiters.remove((me, gate))
            if handed:
                self.release()
            raise
        return True

    def release(self) -> None:
        with self._guard:
            if self._owner != threading.get_ident():
                raise RuntimeError("cannot release a lock this thread does not hold")
            self._depth -= 1
            if self._depth:
                return
            if not self._waiters:
                self._owner = None
                return
            self._owner, gate = self._waiters.popleft()
            self._depth = 1
        gate.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *_: object) -> None:
        self.release()
