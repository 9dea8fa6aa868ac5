"""The workload proxy's connections to each running sandbox's shim socket, pooled."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import httpx

from cubeaccel.cubelet.lifecycle import Cubelet
from cubeaccel.host.service.unix_path import connect_path
from cubeaccel.model.reservation_states import ReservationPhase


class WorkloadUpstreams:
    """One pooled httpx client per running sandbox (and event loop): keep-alive connections on the shim's
    `workload.sock`, so a call reuses an idle connection (one mux stream that the guest keeps serving) instead
    of a new unix connection, mux stream and HTTP connection each time. A client whose socket path changed is
    replaced; sandboxes that stopped running are swept when the cache grows."""

    MAX_CONNECTIONS = 256  # the bridge's stream cap: beyond it a connection would be refused anyway
    KEEPALIVE = 16
    KEEPALIVE_S = 30.0
    SWEEP_ABOVE = 64

    def __init__(self, cubelet: Cubelet) -> None:
        self._cubelet = cubelet
        self._clients: dict[tuple[str, int], tuple[Path, httpx.AsyncClient]] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def get(self, sandbox_id: str, sock: Path) -> httpx.AsyncClient:
        key = (sandbox_id, id(asyncio.get_running_loop()))
        found = self._clients.get(key)
        if found is not None and found[0] == sock and not found[1].is_closed:
            return found[1]
        if found is not None:
            self._retire(found[1])
        if len(self._clients) >= self.SWEEP_ABOVE:
            self._sweep()
        limits = httpx.Limits(
            max_connections=self.MAX_CONNECTIONS,
            max_keepalive_connections=self.KEEPALIVE,
            keepalive_expiry=self.KEEPALIVE_S,
        )
        client = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=connect_path(sock), limits=limits),
            base_url="http://workload",
            timeout=httpx.Timeout(None, connect=10.0),
        )
        self._clients[key] = (sock, client)
        return client

    def drop(self, sandbox_id: str) -> None:
        for key in [k for k in self._clients if k[0] == sandbox_id]:
            self._retire(self._clients.pop(key)[1])

    def _sweep(self) -> None:
        loop = id(asyncio.get_running_loop())
        for key in list(self._clients):
            res = self._cubelet.store.reservation(key[0])
            if key[1] != loop or res is None or res.phase is not ReservationPhase.RUNNING:
                self._retire(self._clients.pop(key)[1])

    def _retire(self, client: httpx.AsyncClient) -> None:
        with contextlib.suppress(RuntimeError):  # its loop is gone: nothing left to close there
            task = asyncio.get_running_loop().create_task(client.aclose())
            self._closing.add(task)  # held until done: the loop keeps only a weak reference to a task
            task.add_done_callback(self._closing.discard)
