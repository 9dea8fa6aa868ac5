"""The web dashboard's data: CubeMaster asks every fresh node's Cubelet at view time (`GET /v1/dashboard`).

CubeMaster keeps only capacity summaries; device states, quarantine reasons and cold-start timelines are the
Cubelets'. Asking them when a page polls (in parallel, with a short timeout, the answer shared by viewers for
`CACHE_S`) shows a quarantine within one poll of it happening, and costs nothing when nobody looks. A node that
does not answer is shown with its error and its last summary.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from pydantic import ValidationError

from cubeaccel.master.node_truth import silent_nodes
from cubeaccel.master.service import CubeMaster, sandbox_record
from cubeaccel.master.warm import warm_rows
from cubeaccel.model.sandbox_states import SandboxState
from cubeaccel.protocol.errors import CubeError
from cubeaccel.wire.master_api import NodeSummary, Sandbox

CACHE_S = 0.25  # viewers polling together share one fan-out
NODE_TIMEOUT_S = 2.0
MAX_EVENTS = 60
MAX_SANDBOXES = 200
SHOWN_STATES = tuple(s for s in SandboxState if s is not SandboxState.DELETED)
PAGE = (Path(__file__).with_name("dashboard.html")).read_text()


class DashboardFeed:
    def __init__(self, master: CubeMaster) -> None:
        self.master = master
        self._lock = threading.Lock()
        self._at = 0.0
        self._last: dict[str, Any] | None = None
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="dashboard")

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            if self._last is None or time.monotonic() - self._at > CACHE_S:
                self._last = self._gather()
                self._at = time.monotonic()
            return self._last

    def _ask(self, url: str) -> dict[str, Any]:
        return self.master.client(url).dashboard(30, timeout=NODE_TIMEOUT_S).model_dump(mode="json", by_alias=True)

    def _gather(self) -> dict[str, Any]:
        now = time.time()
        staleness = self.master.config.staleness_s
        views = sorted(self.master.cache.views(), key=lambda v: v.name)  # the cache (0.25 s TTL)
        summaries = {v.name: v.summary(now, staleness, NodeSummary) for v in views}
        asks = {v.name: self._pool.submit(self._ask, v.cubelet_url) for v in views if not v.stale(now, staleness)}
        nodes: list[dict[str, Any]] = []
        events: list[dict[str, Any]] = []
        phases: dict[str, dict[str, float]] = {}
        for v in views:
            s = summaries[v.name]
            node: dict[str, Any] = {
                "node": v.name,
                "state": s.state,
                "schedulable": s.schedulable,
                "warm_pools": s.model_dump(mode="json", by_alias=True, include={"warm_pools"})["warm_pools"],
            }
            future = asks.get(v.name)
            if future is None:
                node["error"] = {"code": "node.stale", "message": f"no heartbeat for {s.last_heartbeat_age_s} s"}
            else:
                try:
                    got = future.result()
                except (CubeError, httpx.HTTPError, ValidationError) as e:  # a malformed reply: as unreachable
                    code = e.code if isinstance(e, CubeError) else "cubelet.unreachable"
                    node["error"] = {"code": code, "message": str(e)[:300]}
                else:
                    node["devices"] = got.get("devices", [])
                    node["sandboxes"] = got.get("sandboxes", [])
                    events += [{**e, "node": v.name} for e in got.get("events", [])]
                    phases.update({x["sandbox_id"]: x.get("phases", {}) for x in node["sandboxes"]})
            nodes.append(node)
        rows = self.master.store.sandboxes(states=SHOWN_STATES, limit=MAX_SANDBOXES)
        sandboxes = []
        silent = silent_nodes(self.master)
        for r in rows:
            out = sandbox_record(r, Sandbox, silent).model_dump(mode="json", by_alias=True)
            sandboxes.append({**out, "phases": phases.get(str(r.id), {})})
        fresh = [v for v in views if not v.stale(now, staleness)]
        sandboxes += [{**w.model_dump(mode="json", by_alias=True), "phases": {}} for w in warm_rows(fresh)]
        events.sort(key=lambda e: e.get("at") or 0.0, reverse=True)
        return {"at": now, "nodes": nodes, "sandboxes": sandboxes, "events": events[:MAX_EVENTS]}
