"""A fleet of simulated Cubelets, as CubeMaster sees them (docs/master.md, "The fleet simulator").

N nodes in one process: each enrolled at CubeMaster with its own node credential, heartbeating at the production
period (heartbeats.py), answering the Cubelet API on its own loopback address (http.py, api.py) from an in-memory
journal that never hands a device out twice (journal.py). Faults are injected through `Faults`: latency, refused
reservations, dead nodes (`kill`) and stale ones (`silence`). The fleet's `ledger` is its own record of who holds
each device, the benchmark's and the tests' measure of double placement.
"""

from __future__ import annotations

import asyncio
import resource
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

import httpx

from cubeaccel.fleet import http
from cubeaccel.fleet.api import Faults, FleetApi
from cubeaccel.fleet.heartbeats import PERIOD_S, Sender, base_body
from cubeaccel.fleet.journal import FleetLedger, NodeJournal


class Fleet:
    def __init__(
        self,
        masters: list[str],
        admin_key: str,
        nodes: int,
        devices_per_node: int = 8,
        faults: Faults | None = None,
        period_s: float = PERIOD_S,
        senders: int = 4,
        prefix: str | None = None,
        port: int = 0,
    ) -> None:
        """`prefix`: the start of every node name (unique per run by default, so two fleets never share a node)."""
        self.masters = list(masters)
        self.admin_key = admin_key
        self.prefix = prefix or f"sim{uuid.uuid4().hex[:6]}"
        self.ledger = FleetLedger()
        self.journals = [NodeJournal(f"{self.prefix}-{i:05d}", devices_per_node, self.ledger) for i in range(nodes)]
        self.faults = faults or Faults()
        self.period_s = period_s
        self.tokens: list[str] = []
        self.api: FleetApi | None = None
        self.port = port
        self._n_senders = max(1, min(senders, nodes))
        self.senders: list[Sender] = []
        self._loop = asyncio.new_event_loop()
        self._listener: http.NodeListener | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="fleet-api", daemon=True)

    @property
    def names(self) -> list[str]:
        return [j.name for j in self.journals]

    def url(self, i: int) -> str:
        return f"http://{http.node_address(i)}:{self.port}"

    def start(self) -> Fleet:
        _raise_fd_limit()
        self.tokens = self._enrol()
        self.api = FleetApi(self.journals, self.tokens, self.faults)
        self._thread.start()
        self._listener = http.NodeListener(self.api)
        self.port = asyncio.run_coroutine_threadsafe(self._listener.start(self.port), self._loop).result()
        incarnation = uuid.uuid4().hex
        bodies = [base_body(j, self.url(i), incarnation) for i, j in enumerate(self.journals)]
        n = len(self.journals)
        for k in range(self._n_senders):
            s = Sender(
                list(range(k, n, self._n_senders)),
                n,
                self.journals,
                bodies,
                self.tokens,
                lambda: self.masters,
                self._quiet,
                self.period_s,
            )
            s.start()
            self.senders.append(s)
        return self

    def _quiet(self, i: int) -> bool:
        return i in self.faults.dead or i in self.faults.stale

    def _enrol(self) -> list[str]:
        """Each node's credential, asked of CubeMaster with the admin key (as `node-credential enrol` does)."""
        headers = {"Authorization": f"Bearer {self.admin_key}"}
        with httpx.Client(base_url=self.masters[0], headers=headers, timeout=60.0) as c:

            def one(name: str) -> str:
                r = c.post(f"/v1/nodes/{name}/credential")
                r.raise_for_status()
                return str(r.json()["token"])

            with ThreadPoolExecutor(max_workers=8) as pool:
                return list(pool.map(one, self.names))

    def kill(self, i: int) -> None:
        """Node `i` dies: its API closes every connection unanswered and it stops heartbeating; its journal (the
        devices it holds) survives, as a real node's SQLite journal does."""
        self.faults.dead.add(i)

    def revive(self, i: int) -> None:
        self.faults.dead.discard(i)

    def silence(self, i: int, quiet: bool = True) -> None:
        """Node `i` stops heartbeating but still answers (a stale node)."""
        (self.faults.stale.add if quiet else self.faults.stale.discard)(i)

    def report(self) -> dict[str, Any]:
        beats = [s.stats for s in self.senders]
        return {
            "nodes": len(self.journals),
            "devices": sum(len(j.device_ids) for j in self.journals),
            "held": self.ledger.held(),
            "double_placements": self.ledger.double_placements,
            "handed_out": self.ledger.handed_out,
            "released": self.ledger.released,
            "heartbeats_sent": sum(b.sent for b in beats),
            "heartbeats_failed": sum(b.failed for b in beats),
            "heartbeats_late": sum(b.late for b in beats),
            "api": asdict(self.api.counters) if self.api else {},
        }

    def stop(self) -> None:
        for s in self.senders:
            s.stop.set()
        for s in self.senders:
            s.join(timeout=10)
        if self._thread.is_alive():
            if self._listener is not None:
                asyncio.run_coroutine_threadsafe(self._listener.close(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _raise_fd_limit() -> None:
    """CubeMaster keeps a connection per node per replica: lift the soft limit on open files to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
