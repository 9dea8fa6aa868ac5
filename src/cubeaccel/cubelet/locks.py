"""Per-key locks: host work on one device (reset, holder scans, revalidation) must not wait for another's.

Order, where several are taken: a sandbox's key before its devices' keys, and the lifecycle lock last and only
around a short transaction — never the lifecycle lock while host I/O runs.
"""

from __future__ import annotations

import threading
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
