"""Background work of one replica: node reconcile, sandbox timeouts, unfinished deletes.

Reconcile compares CubeMaster's sandbox records for a node with the reservations that node's Cubelet
holds, whenever a node registers or comes back from stale (a restarted Cubelet, a network split):
- a record the Cubelet does not know → `lost` (the user sees it; the devices were never ours to free);
- a reservation CubeMaster has no live record for (a create that died between claim and reply) →
  `DELETE` on the Cubelet, whose release path decides when the devices are safe again.
Master never frees a device itself: a record disappearing only asks the Cubelet to release.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx

from cubeaccel.master.service import CubeMaster
from cubeaccel.model.errors import CubeError

ORPHAN_GRACE_S = 60.0  # a reservation younger than this may belong to a create still in flight


def reconcile_node(master: CubeMaster, name: str) -> dict[str, Any]:
    view = next((v for v in master.cache.views(fresh=True) if v.name == name), None)
    if view is None:
        return {"node": name, "skipped": "unknown node"}
    reservations = master.client(view.cubelet_url).request("GET", "/v1/reservations")["reservations"]
    held = {r["sandbox_id"]: r for r in reservations}
    lost, orphans = [], []
    for row in master.store.sandboxes(states=("running", "deleting"), node=name):
        if row["id"] in held:
            continue
        if row["state"] == "deleting":
            master.store.update_sandbox(row["id"], "deleted", expect=("deleting",), state="deleted")
        else:
            master.store.update_sandbox(row["id"], "lost", expect=("running",), state="lost",
                                        error={"code": "sandbox.lost", "message": f"node {name} holds no "
                                               "reservation for it after a restart", "node": name})
            lost.append(row["id"])
    now = time.time()
    for sid, r in held.items():
        rec = master.store.sandbox(sid)
        live = rec is not None and rec["node"] == name and rec["state"] in ("placing", "running", "deleting")
        young = now - float(r.get("created_at") or 0) < ORPHAN_GRACE_S and rec is not None
        if not live and not young:
            master.client(view.cubelet_url).release(sid)
            orphans.append(sid)
    master.store.mark_reconciled(name, now)
    master.cache.invalidate()
    return {"node": name, "lost": lost, "released_orphans": orphans}


class Maintenance:
    def __init__(self, master: CubeMaster, interval_s: float = 1.0, reconcile_every_s: float = 60.0) -> None:
        self.master = master
        self.interval_s = interval_s
        self.reconcile_every_s = reconcile_every_s  # every node, also without a restart: catches orphans
        self._last_full = time.monotonic()
        self._pending: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="master-maintenance", daemon=True)
        self.last_errors: list[str] = []

    def request_reconcile(self, node: str) -> None:
        with self._lock:
            self._pending.add(node)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def tick(self) -> None:
        if time.monotonic() - self._last_full > self.reconcile_every_s:
            self._last_full = time.monotonic()
            now = time.time()
            for v in self.master.cache.views():
                if not v.stale(now, self.master.config.staleness_s):
                    self.request_reconcile(v.name)
        with self._lock:
            pending, self._pending = self._pending, set()
        for node in sorted(pending):
            try:
                reconcile_node(self.master, node)
            except (CubeError, httpx.HTTPError, KeyError) as e:
                self._note(f"reconcile {node}: {e}")
                with self._lock:
                    self._pending.add(node)  # try again next tick
        now = time.time()
        for row in self.master.store.sandboxes(states=("running",)):
            if row["expires_at"] is not None and row["expires_at"] < now:
                self.master.store.update_sandbox(row["id"], "timeout", expect=("running",), state="deleting")
        for row in self.master.store.sandboxes(states=("deleting",)):
            self.master.release(row)

    def _note(self, msg: str) -> None:
        self.last_errors = [*self.last_errors[-19:], msg]

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            except Exception as e:  # a failed tick is retried; the error is visible on /v1/health
                self._note(f"tick: {type(e).__name__}: {e}")
