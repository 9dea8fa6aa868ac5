"""Cubelet → CubeMaster: a sandbox became ready, or failed (code and layer), pushed the moment it happens.

The lifecycle only enqueues (it may hold the node lock); one thread delivers, retrying a few times. A push that
never arrives is not lost knowledge: CubeMaster polls `starting` sandboxes and reads a closed reservation's
failure from the event trail on reconcile.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import httpx

from cubeaccel.transport.node_sig import NodeAuth
from cubeaccel.wire.master_api import StatusBody

RETRIES = 5
RETRY_WAIT_S = 0.5


class StatusPush:
    def __init__(
        self,
        master_url: str,
        node: str,
        timeout_s: float = 5.0,
        token: str | Callable[[], str | None] | None = None,
    ) -> None:
        self.auth = NodeAuth(token) if token else None  # each push signed (transport/node_sig.py)
        self.base = f"{master_url.rstrip('/')}/v1/nodes/{node}/sandboxes"
        self.timeout_s = timeout_s
        self._queue: queue.Queue[tuple[str, StatusBody] | None] = queue.Queue(maxsize=10000)
        self._thread = threading.Thread(target=self._run, name="cubelet-status-push", daemon=True)
        self._stop = threading.Event()
        self.delivered = 0
        self.dropped = 0

    def push(self, sandbox_id: str, status: StatusBody) -> None:
        try:
            self._queue.put_nowait((sandbox_id, status))
        except queue.Full:
            self.dropped += 1  # the poll fallback covers it

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._queue.put(None)

    def _run(self) -> None:
        with httpx.Client(timeout=self.timeout_s, auth=self.auth) as http:
            while (item := self._queue.get()) is not None:
                sid, status = item
                body = status.model_dump(mode="json")
                for _ in range(RETRIES):
                    try:
                        r = http.put(f"{self.base}/{sid}/status", json=body)
                        if r.status_code < 500:  # 4xx: the master does not know it (any more): nothing to retry
                            self.delivered += r.status_code < 300
                            break
                    except httpx.HTTPError:
                        pass
                    if self._stop.wait(RETRY_WAIT_S):
                        return
