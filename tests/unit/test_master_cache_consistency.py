"""CubeMaster's node cache never shows more free devices than a node has: the views and the claims it
derives free counts from describe the same heartbeat, even when one lands while the cache reloads."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cubeaccel.master.cache import NodeCache
from cubeaccel.master.store import MasterStore, NodeLiveness
from cubeaccel.master.view import NodeView
from cubeaccel.model.sandbox_states import SandboxActor, SandboxEvent
from tests.support.master_builders import group, heartbeat, sandbox_row

H100 = "H100-PCIe-80GB"
GIB = 1024


@pytest.fixture
def store(tmp_path: Path) -> Iterator[MasterStore]:
    s = MasterStore(str(tmp_path / "m.db"))
    yield s
    s.close()


def test_a_heartbeat_landing_during_a_reload_frees_neither_a_held_device_nor_its_locked_memory(
    store: MasterStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = heartbeat("n", group(H100, 2), pinnable=100 * GIB)
    before["sent_at"] = 1000.0
    store.heartbeat(before, time.time(), 10)
    key = store.all_node_views()[0].groups[0].key
    store.insert_sandbox(sandbox_row("a", time.time()))
    assert store.admit("a", "n", key, 1, time.time(), 10, pinned_mib=40 * GIB)
    store.update_sandbox(
        "a", "reserved", event=SandboxEvent.READY, by=SandboxActor.PLACEMENT, cubelet_created_at=1500.0
    )
    after = heartbeat("n", group(H100, 2, free=1), pinnable=60 * GIB)  # the summary that counts the reservation
    after["sent_at"] = 1501.0

    read_views = store.node_views
    landed: list[object] = []

    def views_then_heartbeat(*args: Any, **kwargs: Any) -> tuple[list[NodeView], list[NodeLiveness]]:
        out = read_views(*args, **kwargs)
        if not landed:  # the heartbeat lands just after the cache read the views, once
            landed.append(store.heartbeat(after, time.time(), 10))
        return out

    monkeypatch.setattr(store, "node_views", views_then_heartbeat)
    (view,) = NodeCache(store).views(fresh=True)
    assert landed
    assert (view.free(view.groups[0]), view.free_pinnable_mib()) == (1, 60 * GIB)


def test_without_a_heartbeat_in_between_the_claims_are_the_aggregate_ones(store: MasterStore) -> None:
    """The usual reload reads the claims in one statement with each node's `sent_at`; they equal `claims()` and
    `admitted_memory()`, and a reservation the summary already shows is no claim."""
    for node in ("n", "m"):
        hb = heartbeat(node, group(H100, 4), pinnable=100 * GIB)
        hb["sent_at"] = 1000.0
        store.heartbeat(hb, time.time(), 10)
    key = store.all_node_views()[0].groups[0].key
    for sid, created in (("seen", 900.0), ("unseen", 1100.0), ("placing", None)):
        store.insert_sandbox(sandbox_row(sid, time.time()))
        assert store.admit(sid, "n", key, 1, time.time(), 10, pinned_mib=10 * GIB)
        if created is not None:
            store.update_sandbox(
                sid, "reserved", event=SandboxEvent.READY, by=SandboxActor.PLACEMENT, cubelet_created_at=created
            )
    as_of = store.admitted_as_of()
    assert {n: (c.sent_at, c.devices, c.memory_mib) for n, c in as_of.items()} == {
        "n": (1000.0, {key: 2}, 20 * GIB),
        "m": (1000.0, {}, 0),
    }
    assert store.admitted() == {"n": {key: 2}} and store.admitted_memory() == {"n": 20 * GIB}
    (n, m) = sorted(NodeCache(store).views(fresh=True), key=lambda v: v.name != "n")
    assert (n.free(n.groups[0]), m.free(m.groups[0])) == (2, 4)
