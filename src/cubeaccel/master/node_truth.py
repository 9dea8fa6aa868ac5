"""What a node's heartbeat says about its sandboxes, and what CubeMaster shows while a node says nothing.

Issue 30 #8: a Cubelet that died together with its VMs and came back inside the staleness bound was never seen
to leave, so CubeMaster said `running` until its periodic reconcile. Now each heartbeat carries the Cubelet's
incarnation (new per process) and the sandboxes it ended on its own: the ends are applied at once (`failed` with
the node's code and layer), and a changed incarnation asks for the node's reconcile at once (a sandbox the node
has no record of at all becomes `lost` there). While a node's heartbeats are stale its live sandboxes are shown
`unknown` (the stored state is kept in `last_known_state`): nobody knows whether they still run, and the node may
come back with them.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from cubeaccel.master.service import CubeMaster, sandbox_error
from cubeaccel.master.shown import LIVE_STATES
from cubeaccel.model.sandbox_states import SandboxActor, SandboxEvent, SandboxState
from cubeaccel.wire.heartbeat import EndedSandbox, NodeNews

SS = SandboxState
SETTLED_KEPT = 8192  # ends already applied (or not applicable), not read again on the next heartbeats


class NodeTruth:
    def __init__(self, master: CubeMaster, request_reconcile: Callable[[str], None] | None) -> None:
        self.master = master
        self.request_reconcile = request_reconcile
        self._lock = threading.Lock()
        self._incarnations: dict[str, str] = {}
        self._settled: OrderedDict[tuple[str, str, float], None] = OrderedDict()

    def heard(self, node: str, heartbeat: NodeNews) -> None:
        """A heartbeat was stored: apply its ends, and reconcile a node this replica sees in a new incarnation
        (or for the first time: a restarted CubeMaster does not know what it missed)."""
        for e in heartbeat.ended:
            self._apply(node, e)
        if heartbeat.incarnation is None:
            return
        with self._lock:
            seen = self._incarnations.get(node)
            self._incarnations[node] = heartbeat.incarnation
        if seen != heartbeat.incarnation and self.request_reconcile is not None:
            self.request_reconcile(node)

    def _apply(self, node: str, e: EndedSandbox) -> None:
        key = (node, e.sandbox_id, e.created_at)
        with self._lock:
            if key in self._settled:
                return
        row = self.master.store.sandbox(e.sandbox_id)
        if row is not None and row.node == node and row.state is SS.PLACING:
            return  # the create's reply settles it; look again next heartbeat
        ours = (
            row is not None
            and row.node == node
            and row.state in LIVE_STATES  # `placing` is its create's to settle
            and row.cubelet_created_at in (None, e.created_at)  # a later sandbox reusing the id is not this one
        )
        if ours:
            self.master.store.update_sandbox(
                e.sandbox_id,
                "failed",
                expect=LIVE_STATES,
                event=SandboxEvent.FAIL,
                by=SandboxActor.CUBELET,
                error=sandbox_error(e.error).model_copy(update={"node": node}),
            )
            self.master.cache.invalidate()
        with self._lock:
            self._settled[key] = None
            while len(self._settled) > SETTLED_KEPT:
                self._settled.popitem(last=False)


def silent_nodes(master: CubeMaster) -> frozenset[str]:
    """Nodes whose last heartbeat is older than the staleness bound."""
    now, bound = time.time(), master.config.staleness_s
    return frozenset(v.name for v in master.cache.views() if v.stale(now, bound))
