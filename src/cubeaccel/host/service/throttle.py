"""Throttling of repeated authentication failures, per presented credential (CubeMaster's API, the Cubelet's TCP
listener): callers count only failures, so a valid credential is never refused (issue 30 #3)."""

from __future__ import annotations

import threading
import time
from collections import deque

from cubeaccel.protocol.errors import CubeError

MAX_TRACKED = 10000  # made-up credentials each get an entry: at most this many are remembered


class Throttle:
    """At most `limit` authentication failures per credential in `window_s`; beyond that a failure is a 429."""

    def __init__(self, limit: int = 20, window_s: float = 60.0) -> None:
        self.limit, self.window_s = limit, window_s
        self._fails: dict[str, deque[float]] = {}
        self._lock = threading.Lock()

    def _recent(self, source: str, now: float) -> deque[float]:
        q = self._fails.setdefault(source, deque())
        while q and q[0] < now - self.window_s:
            q.popleft()
        return q

    def check(self, source: str) -> None:
        with self._lock:
            if len(self._recent(source, time.monotonic())) >= self.limit:
                raise CubeError(
                    "auth.throttled",
                    f"too many failed authentications with this credential; retry after {self.window_s:g}s",
                    "api",
                )

    def fail(self, source: str) -> None:
        with self._lock:
            self._recent(source, time.monotonic()).append(time.monotonic())
            if len(self._fails) > MAX_TRACKED:  # bounded: forget the ones with no recent failure, then the oldest
                for s in [s for s, q in self._fails.items() if not q]:
                    del self._fails[s]
                while len(self._fails) > MAX_TRACKED:
                    del self._fails[next(iter(self._fails))]
