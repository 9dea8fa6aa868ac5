"""Node views indexed by capacity group and free count, so a placement does not visit every node.

The full scan (`scheduler.evaluate`) costs ~1-1.6 µs of CPU per node per decision: at 10,000 nodes that is the
whole budget. Here every schedulable (node, group) pair with at least one free device is an entry in a sorted
list per group key (class + labels) and NUMA width, ordered exactly as the scan ranks candidates: free count
(packing), then the node's total free, then name, then the group's position. A decision merges the lists of the
group keys that pass the request's filters, starting at `free >= count`, and stops after `keep` candidates that
also pass the per-node checks (staleness, contract): its cost follows the number of distinct label sets and the
candidates skipped, not the number of nodes.

Entries are also split by the node's boot facts (backends, guest images, hot-plug paths, devices per sandbox)
and by the power of two of its free lockable memory, so a contract (or a count) a whole class of nodes cannot meet
skips their entries in one step: otherwise the nodes no template fits would stay at the front of the packing order
and every decision would walk over them. Entries change only when a node's view (heartbeat, operator state) or
what was admitted on it changes; `NodeCache` makes those calls. Draining and not-ready nodes have no entries;
staleness depends on the clock, so it is checked while merging. A refusal still runs the thorough `explain` over
every view, so its reasons are the same.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from sortedcontainers import SortedList

from cubeaccel.master.view import Group, NodeView
from cubeaccel.model.sandbox_states import NodeState

# (free, node_free, node name, group position): ascending = best first for equal NUMA locality
Entry = tuple[int, int, str, int]


# (group key, boot facts, bit length of free lockable MiB)
SlotKey = tuple[str, Hashable, int]


def facts_key(v: NodeView) -> Hashable:
    return (v.backends, v.guest_images, v.hotplug, v.max_devices)


@dataclass
class Slot:
    """Entries of one group key on nodes with the same boot facts and lockable-memory magnitude. `group` and
    `node` are any one of them: what the slot's entries share (labels, facts) is read from them."""

    group: Group
    node: NodeView
    memory_bits: int  # every node here has free lockable MiB < 2**memory_bits
    by_width: dict[int, SortedList] = field(default_factory=dict)  # widest NUMA node's free count → entries

    def streams(self, count: int) -> Iterator[tuple[bool, Iterator[Entry]]]:
        """Per NUMA width: whether `count` devices fit on one NUMA node, and the entries with free >= count."""
        for width, entries in self.by_width.items():
            yield count == 1 or width >= count, entries.irange(minimum=(count,))


class NodeIndex:
    def __init__(self) -> None:
        self._views: dict[str, NodeView] = {}
        self._slots: dict[SlotKey, Slot] = {}
        self._entries: dict[str, list[tuple[SlotKey, int, Entry]]] = {}  # node → (slot, width, entry)
        self.facts_memo: dict[tuple[str, Hashable], bool] = {}  # (contract digest, facts) → boot facts fit

    def views(self) -> list[NodeView]:
        return list(self._views.values())

    def view(self, name: str) -> NodeView:
        return self._views[name]

    def slots(self) -> Iterable[Slot]:
        return self._slots.values()

    def __len__(self) -> int:
        return len(self._views)

    def put(self, view: NodeView) -> None:
        """A new or changed view (what was admitted already attached)."""
        self._drop_entries(view.name)
        self._views[view.name] = view
        self._add_entries(view)

    def remove(self, name: str) -> None:
        self._drop_entries(name)
        self._views.pop(name, None)

    def set_admitted(self, name: str, admitted: Mapping[str, int], memory_mib: int) -> None:
        """Claims changed the node's free counts (memory claims only feed the contract check, not the order)."""
        v = self._views.get(name)
        if v is None:
            return
        bits = v.free_pinnable_mib().bit_length()
        v.admitted_memory_mib = memory_mib
        if v.admitted == admitted and v.free_pinnable_mib().bit_length() == bits:
            return
        v.admitted = dict(admitted)
        self._drop_entries(name)
        self._add_entries(v)

    def replace_all(self, views: Iterable[NodeView]) -> None:
        """Keep exactly `views`: unchanged objects are left alone, changed claims re-indexed."""
        wanted = {v.name: v for v in views}
        for name in [n for n in self._views if n not in wanted]:
            self.remove(name)
        for name, v in wanted.items():
            if self._views.get(name) is not v:
                self.put(v)

    def _add_entries(self, v: NodeView) -> None:
        if v.state != NodeState.READY or not v.host_ready:
            return
        node_free = sum(max(0, v.free(g)) for g in v.groups)
        facts, bits = facts_key(v), v.free_pinnable_mib().bit_length()
        added: list[tuple[SlotKey, int, Entry]] = []
        for pos, g in enumerate(v.groups):
            free = v.free(g)
            if free < 1:
                continue
            width = max(g.by_numa.values(), default=0)
            entry = (free, node_free, v.name, pos)
            key = (g.key, facts, bits)
            slot = self._slots.get(key)
            if slot is None:
                slot = self._slots[key] = Slot(g, v, bits)
            slot.by_width.setdefault(width, SortedList()).add(entry)
            added.append((key, width, entry))
        if added:
            self._entries[v.name] = added

    def _drop_entries(self, name: str) -> None:
        for key, width, entry in self._entries.pop(name, []):
            slot = self._slots[key]
            entries = slot.by_width[width]
            entries.remove(entry)
            if not entries:
                del slot.by_width[width]
                if not slot.by_width:
                    del self._slots[key]
