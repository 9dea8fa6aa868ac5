"""A replica's short-lived copy of the node views, so a decision does not read every node row.

Views are refreshed from the store at most every `ttl_s`, and only the nodes whose heartbeat or state
changed are re-read and re-parsed; the others keep their contract and device memos and get new claims.
A decision made on a copy that is a little old is safe: the claim is re-checked under the node's row
lock in the store.
"""

from __future__ import annotations

import threading
import time

from cubeaccel.master.store import MasterStore
from cubeaccel.master.view import NodeView


class NodeCache:
    def __init__(self, store: MasterStore, ttl_s: float = 0.25) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._views: dict[str, NodeView] = {}
        self._loaded_at = 0.0

    def views(self, fresh: bool = False) -> list[NodeView]:
        with self._lock:
            if fresh or time.monotonic() - self._loaded_at > self.ttl_s:
                self._reload()
            return list(self._views.values())

    def invalidate(self) -> None:
        with self._lock:
            self._loaded_at = 0.0

    def note_claim(self, node: str, group_key: str, count: int, pinned_mib: int = 0) -> None:
        """Our own claim, visible to this replica's next decisions before the next reload."""
        with self._lock:
            v = self._views.get(node)
            if v is not None:
                v.claims = {**v.claims, group_key: v.claims.get(group_key, 0) + count}
                v.memory_claims_mib += pinned_mib

    def _reload(self) -> None:
        known = {name: (v.received_at, v.state) for name, v in self._views.items()}
        changed, names = self.store.node_views(known)
        claims, memory = self.store.claims(), self.store.memory_claims()
        fresh = {name: self._views[name] for name in names if name in self._views}
        fresh.update({v.name: v for v in changed})  # unchanged views keep their contract and device memos
        for name, v in fresh.items():
            v.claims = claims.get(name, {})
            v.memory_claims_mib = memory.get(name, 0)
        self._views = fresh
        self._loaded_at = time.monotonic()
