"""Throttling of repeated authentication failures, per source (CubeMaster's API, the Cubelet's TCP listener)."""

from __future__ import annotations

import threading
import time
from collections import deque

from cubeaccel.model.errors import CubeError


class Throttle:
    """At most `limit` authentication failures per source in `window_s`; beyond that, 429 without checking."""

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
                    f"too many failed authentications from this source; retry after {self.window_s:g}s",
                    "api",
                    {},
                    429,
                )

    def fail(self, source: str) -> None:
        with self._lock:
            self._recent(source, time.monotonic()).append(time.monotonic())
            if len(self._fails) > 10000:  # bounded: forget the sources with no recent failure
                for s in [s for s, q in self._fails.items() if not q]:
                    del self._fails[s]
