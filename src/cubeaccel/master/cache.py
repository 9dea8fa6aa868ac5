"""A replica's short-lived copy of the node views, so a decision does not read every node row.

Views are refreshed from the store at most every `ttl_s`, and only the nodes whose heartbeat or state
changed are re-read and re-parsed; the others keep their contract and device memos and get new claims.
A decision made on a copy that is a little old is safe: the claim is re-checked under the node's row
lock in the store. The views are also kept in a `NodeIndex`, so `decide` does not visit every node; decisions
run under the cache's lock, since the index's sorted lists must not change under a merge.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from cubeaccel.master.index import NodeIndex
from cubeaccel.master.scheduler import Decision, decide
from cubeaccel.master.selector import Selector
from cubeaccel.master.store import HeartbeatRecorded, MasterStore, Placement
from cubeaccel.master.view import NodeView
from cubeaccel.model.contract import CompatibilityContract
from cubeaccel.model.request import AcceleratorChoice


class NodeCache:
    def __init__(self, store: MasterStore, ttl_s: float = 0.25) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self._lock = threading.Lock()  # the index and the maps: held for lookups and merges, never across I/O
        self._reloading = threading.Lock()  # one reload at a time; its reads run without `_lock`
        self._index = NodeIndex()
        self._by_url: dict[str, str] = {}  # cubelet_url → node, for the Cubelet calls that start from a URL
        self._loaded_at = 0.0  # monotonic time the last merged reload started reading
        self._invalidated_at = 0.0
        # Our own claims noted while a reload reads: re-applied after its merge, which may not show them yet
        # (counted twice until the next reload if it does: a node looks fuller, never freer, than it is).
        self._noted: list[tuple[str, str, int, int]] | None = None

    def views(self, fresh: bool = False) -> list[NodeView]:
        self._refresh(fresh)
        with self._lock:
            return self._index.views()

    def view(self, name: str) -> NodeView | None:
        """One node's view by name, without a copy of every view: a Cubelet call per create must not visit the
        whole fleet. Reloaded (within the TTL rule) only when the copy does not hold the node yet."""
        with self._lock:
            try:
                return self._index.view(name)
            except KeyError:
                pass
        self._refresh()
        with self._lock:
            try:
                return self._index.view(name)
            except KeyError:
                return None

    def node_at(self, url: str) -> str | None:
        """The node registered at `url`, looked up the same way as `view`."""
        with self._lock:
            name = self._by_url.get(url)
        if name is None:
            self._refresh()
            with self._lock:
                name = self._by_url.get(url)
        return name

    def decide(
        self,
        choices: Sequence[tuple[AcceleratorChoice, CompatibilityContract, Selector | None]],
        now: float,
        staleness_s: float,
        vcpus: int = 1,
        fresh: bool = False,
    ) -> tuple[Decision, int]:
        """A decision over the indexed views, and how many nodes it was made over (for the refusal's counts)."""
        self._refresh(fresh)
        with self._lock:
            # the index is the node list: no per-decision copy of every view (a refusal's `explain` reads them)
            return decide((), choices, now, staleness_s, vcpus, index=self._index), len(self._index)

    def invalidate(self) -> None:
        with self._lock:
            self._invalidated_at = time.monotonic()

    def heard(self, beat: HeartbeatRecorded) -> None:
        """A heartbeat this replica stored for a node that was new or stale. A copy holding the same summary and
        state takes the beat's clocks, with no read (its claims stay relative to the older `sent_at`: they may
        count a placement the new summary shows, a node fuller than it is until the next reload, never freer);
        otherwise the node is read from its row."""
        with self._lock:
            try:
                v = self._index.view(beat.node)
            except KeyError:
                v = None
            if v is not None and (v.summary_digest, v.state) == (beat.digest, beat.state):
                v.received_at, v.sent_at = beat.received_at, beat.sent_at
                return
        self.refresh_node(beat.node)

    def refresh_node(self, name: str) -> None:
        """Take in one node from its row (one read, not every node's): a node that appeared or came back, or one
        whose claims changed. Keeps the view object (and its memos) when its summary and state did not change."""
        fresh = self.store.node_view(name)
        with self._lock:
            try:
                v: NodeView | None = self._index.view(name)
            except KeyError:
                v = None
            if fresh is None:
                if v is not None:  # gone from the store: the next caller reloads
                    self._invalidated_at = time.monotonic()
                return
            if v is None or (v.summary_digest, v.state) != (fresh.summary_digest, fresh.state):
                if v is not None and self._by_url.get(v.cubelet_url) == name:
                    del self._by_url[v.cubelet_url]
                self._index.put(fresh)
                self._by_url[fresh.cubelet_url] = name
                v = fresh
            else:
                v.received_at, v.sent_at = fresh.received_at, fresh.sent_at
                self._index.set_admitted(name, fresh.admitted, fresh.admitted_memory_mib)
            v.warm_claimed = fresh.warm_claimed
            if self._noted is not None:  # a reload under way read before this: its merge must not undo it
                self._invalidated_at = time.monotonic()

    def note_admitted(self, node: str, group_key: str, count: int, pinned_mib: int = 0) -> None:
        """Our own claim, visible to this replica's next decisions before the next reload."""
        with self._lock:
            if self._noted is not None:
                self._noted.append((node, group_key, count, pinned_mib))
            self._add_claim(node, group_key, count, pinned_mib)

    def _add_claim(self, node: str, group_key: str, count: int, pinned_mib: int) -> None:
        try:
            v = self._index.view(node)
        except KeyError:
            return
        claims = {**v.admitted, group_key: v.admitted.get(group_key, 0) + count}
        self._index.set_admitted(node, claims, v.admitted_memory_mib + pinned_mib)

    def _refresh(self, fresh: bool = False) -> None:
        """Reload when the copy is older than the TTL, invalidated, or the caller asks for a fresh one.

        Past the TTL alone, a caller finding a reload under way decides on the current copy instead of waiting
        for it (the store re-checks every claim under the node's row lock). A fresh or invalidated copy is
        waited for, and read again unless a reload started after the caller asked."""
        asked = time.monotonic()
        with self._lock:
            must = fresh or self._loaded_at <= self._invalidated_at
            if not must and asked - self._loaded_at <= self.ttl_s:
                return
        if not self._reloading.acquire(blocking=must):
            return
        try:
            with self._lock:
                done = self._loaded_at > (asked if fresh else self._invalidated_at)
                if done and (must or time.monotonic() - self._loaded_at <= self.ttl_s):
                    return
            self._reload()
        finally:
            self._reloading.release()

    def _reload(self) -> None:
        """Re-parse only the nodes whose summary or state changed; the others keep their view (and its memos) and
        take the row's new clocks, since a heartbeat that repeated its summary renewed only those. The store is
        read without the index's lock; only the merge holds it."""
        started = time.monotonic()
        with self._lock:
            old = {v.name: v for v in self._index.views()}
            self._noted = []
        try:
            known = {name: (v.summary_digest, v.state) for name, v in old.items()}
            changed, liveness = self.store.node_views(known)
            as_of = self.store.admitted_as_of()
            warm = self.store.warm_claimed()
        except BaseException:
            with self._lock:
                self._noted = None
            raise
        fresh = {x.name: old[x.name] for x in liveness if x.name in old}
        clocks = {x.name: (x.received_at, x.sent_at) for x in liveness if x.name in old}
        for v in changed:  # unchanged views keep their contract and device memos
            fresh[v.name] = v
            clocks[v.name] = (v.received_at, v.sent_at)
        # A view's claims must be relative to the summary it holds. A heartbeat that landed after the views were
        # read makes the claims relative to a newer one, which would free a device the view still shows held:
        # those few nodes' claims are derived again from their placements, against the view's own summary.
        torn = [name for name in fresh if (c := as_of.get(name)) is None or c.sent_at != clocks[name][1]]
        placed: dict[str, list[Placement]] = {name: [] for name in torn}
        for p in self.store.placements(torn) if torn else []:
            placed[p.node].append(p)

        def claims_of(name: str) -> tuple[dict[str, int], int]:
            if name in placed:
                return unseen_admitted(placed[name], clocks[name][1])
            c = as_of[name]
            return c.devices, c.memory_mib

        claims = {name: claims_of(name) for name in fresh}
        for v in changed:
            v.admitted, v.admitted_memory_mib = claims[v.name]
        with self._lock:
            for name, v in fresh.items():
                v.received_at, v.sent_at = clocks[name]
            self._index.replace_all(fresh.values())
            self._by_url = {v.cubelet_url: v.name for v in fresh.values()}
            for name, v in fresh.items():
                self._index.set_admitted(name, *claims[name])
                v.warm_claimed = warm.get(name, frozenset())
            for noted in self._noted or []:
                self._add_claim(*noted)
            self._noted = None
            self._loaded_at = started


def unseen_admitted(placements: Sequence[Placement], sent_at: float) -> tuple[dict[str, int], int]:
    """Devices per group key and MiB of lockable memory placed on a node that its summary sent at `sent_at`
    cannot show."""
    devices: dict[str, int] = {}
    memory = 0
    for p in placements:
        if p.unseen_by(sent_at):
            if p.group_key is not None:
                devices[p.group_key] = devices.get(p.group_key, 0) + p.count
            memory += p.pinned_mib
    return devices, memory
