"""The simulated nodes' heartbeats: each node signs its own `PUT /v1/nodes/{node}` with its own token at the
production period (the Cubelet's tick, 2 s), spread evenly over the period, body built from the wire model the
Cubelet sends (`wire.heartbeat.Heartbeat`) with the node's journal read at each beat.

A few sender threads with one keep-alive connection per CubeMaster each: a thread per node would be 10,000
threads. Node `i` beats to CubeMaster `i mod R` and, when that one does not answer, to the next (what a load
balancer in front of the replicas does). A sender that falls behind sends at once and counts the lag, so the
report says whether the simulator kept the period.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from cubeaccel import __version__
from cubeaccel.cubelet.shim_driver import SIMULATED_HOTPLUG, simulated_guest_images
from cubeaccel.fleet.journal import NodeJournal
from cubeaccel.fleet.replies import GPU_LABELS
from cubeaccel.transport import node_sig
from cubeaccel.wire.heartbeat import Heartbeat

PERIOD_S = 2.0  # the Cubelet's default tick (`cubelet serve --tick`)


@dataclass
class BeatStats:
    sent: int = 0
    failed: int = 0
    late: int = 0  # beats sent more than half a period after their time
    seconds: float = 0.0  # wall time spent sending


def base_body(j: NodeJournal, url: str, incarnation: str) -> dict[str, Any]:
    """Node `j`'s heartbeat with everything but the clock and the counts: checked once against the wire model."""
    images = [i.to_json() for i in simulated_guest_images()]
    body = Heartbeat.model_validate(
        {
            "node": j.name,
            "cubelet_url": url,
            "version": __version__,
            "capacity": capacity(j),
            "pinnable_memory_mib": 1 << 20,
            "guest_images": images,
            "hotplug": list(SIMULATED_HOTPLUG),
            "max_devices_per_sandbox": len(j.device_ids),
            "incarnation": incarnation,
            "sent_at": time.time(),
        }
    ).to_json()
    return body


def capacity(j: NodeJournal) -> dict[str, Any]:
    free, total = j.free, len(j.device_ids)
    return {
        "node": j.name,
        "backends": ["vfio"],
        "total": total,
        "by_state": {"allocatable": free, "attached": total - free},
        "allocatable": free,
        "groups": [
            {
                "class": "gpu",
                "labels": {**GPU_LABELS, "backend": "vfio"},
                "total": total,
                "by_state": {"allocatable": free, "attached": total - free},
                "allocatable_by_numa": j.free_by_numa(),
            }
        ],
        "unavailable_reasons": {},
    }


class Sender(threading.Thread):
    """Beats for `nodes` (indices), each at its slot in the period."""

    def __init__(
        self,
        nodes: list[int],
        total_nodes: int,
        journals: list[NodeJournal],
        bodies: list[dict[str, Any]],
        tokens: list[str],
        masters: Callable[[], list[str]],
        skip: Callable[[int], bool],
        period_s: float,
    ) -> None:
        super().__init__(name="fleet-heartbeats", daemon=True)
        self.nodes, self.total = nodes, total_nodes
        self.journals, self.bodies, self.tokens = journals, bodies, tokens
        self.masters, self.skip, self.period = masters, skip, period_s
        self.stats = BeatStats()
        self.stop = threading.Event()
        self._conns: dict[str, http.client.HTTPConnection] = {}

    def run(self) -> None:
        t0 = time.time()
        cycle = 0
        while not self.stop.is_set():
            for i in self.nodes:
                due = t0 + (cycle + i / self.total) * self.period
                wait = due - time.time()
                if wait > 0 and self.stop.wait(wait):
                    return
                if wait < -self.period / 2:
                    self.stats.late += 1
                if not self.skip(i):
                    self.beat(i)
            cycle += 1
        for c in self._conns.values():
            c.close()

    def beat(self, i: int) -> bool:
        t = time.perf_counter()
        j = self.journals[i]
        body = {**self.bodies[i], "capacity": capacity(j), "sent_at": time.time()}
        data = json.dumps(body, separators=(",", ":")).encode()
        path = f"/v1/nodes/{j.name}"
        masters = self.masters()
        ok = False
        for k in range(len(masters)):
            url = masters[(i + k) % len(masters)]
            headers = node_sig.sign(self.tokens[i], "PUT", path, data)
            headers["content-type"] = "application/json"
            if self._put(url, path, data, headers):
                ok = True
                break
        self.stats.sent += ok
        self.stats.failed += not ok
        self.stats.seconds += time.perf_counter() - t
        return ok

    def _put(self, url: str, path: str, data: bytes, headers: dict[str, str]) -> bool:
        conn = self._conns.get(url)
        try:
            if conn is None:
                u = urlsplit(url)
                conn = self._conns[url] = http.client.HTTPConnection(u.hostname or "", u.port, timeout=5.0)
            conn.request("PUT", path, data, headers)
            r = conn.getresponse()
            r.read()
            return r.status < 300
        except (OSError, http.client.HTTPException):
            self._conns.pop(url, None)
            if conn is not None:
                conn.close()
            return False
