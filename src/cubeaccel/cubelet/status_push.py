"""Cubelet → CubeMaster: a sandbox became ready, or failed (code and layer), pushed the moment it happens.

The lifecycle only enqueues (it may hold the node lock); one thread delivers, retrying a few times. A push that
never arrives is not lost knowledge: CubeMaster polls `starting` sandboxes and reads a closed reservation's
failure from the event trail on reconcile.

Each push is `Calls.sandbox_status` through the typed CubeMaster client (`transport/master_client.py`), signed with
the node's token.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import httpx
from pydantic import ValidationError

from cubeaccel.protocol.errors import CubeError
from cubeaccel.transport.master_client import MasterClient
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
        self.master_url = master_url
        self.node = node
        self.token = token  # each push signed with it (transport/node_sig.py)
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
        master = MasterClient(self.master_url, timeout=self.timeout_s, node_token=self.token)
        try:
            while (item := self._queue.get()) is not None:
                if not self._deliver(master, *item):
                    return
        finally:
            master.close()

    def _deliver(self, master: MasterClient, sandbox_id: str, status: StatusBody) -> bool:
        """One push, retried while CubeMaster cannot be reached or fails (5xx); False once stopped."""
        for _ in range(RETRIES):
            try:
                master.sandbox_status(self.node, sandbox_id, status)
                self.delivered += 1
                return True
            except CubeError as e:
                if e.status < 500:  # 4xx: the master does not know it (any more): nothing to retry
                    return True
            except ValidationError:  # answered, with a reply this node cannot read: the push is not repeated
                return True
            except httpx.HTTPError:
                pass
            if self._stop.wait(RETRY_WAIT_S):
                return False
        return True
