"""A Cubelet call finds its node through the cache's maps, never through a copy of every node's view: with
10,000 nodes a scan per create and per delete is a cost that grows with the fleet (bench/fleet_bench.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cubeaccel.master.cache import NodeCache
from cubeaccel.master.service import CubeMaster
from cubeaccel.master.store import MasterStore, NodeLiveness
from cubeaccel.master.view import NodeView
from tests.support.master_builders import group, heartbeat


@pytest.fixture
def master(tmp_path: Path) -> Iterator[CubeMaster]:
    m = CubeMaster(MasterStore(str(tmp_path / "m.db")))
    for i in range(3):
        m.store.heartbeat(
            heartbeat(f"n{i}", group("H100-SXM5-80GB", 8), url=f"http://127.1.0.{i + 1}:7"), time.time(), 10
        )
    m.auth.enrol_node("n1")
    yield m
    m.store.close()


def test_a_cubelet_call_finds_its_node_and_token_without_visiting_every_node(
    master: CubeMaster, monkeypatch: pytest.MonkeyPatch
) -> None:
    master.cache.views()  # the copy is loaded
    copies: list[int] = []
    real = NodeCache.views

    def counted(self: NodeCache, fresh: bool = False) -> list[NodeView]:
        copies.append(1)
        return real(self, fresh)

    monkeypatch.setattr(NodeCache, "views", counted)

    assert master.node_url("n1") == "http://127.1.0.2:7"
    client = master.client("http://127.1.0.2:7")
    assert client._http.auth is not None  # n1's token signs the calls: the node was found by its URL
    assert copies == []


def test_a_node_the_copy_does_not_hold_yet_is_found_after_a_reload(master: CubeMaster) -> None:
    master.cache.views()
    master.store.heartbeat(heartbeat("n9", group("H100-SXM5-80GB", 8), url="http://127.1.0.9:7"), time.time(), 10)
    master.cache.invalidate()
    assert master.node_url("n9") == "http://127.1.0.9:7"
    assert master.cache.node_at("http://127.1.0.9:7") == "n9"
    assert master.node_url("nobody") is None


class _NoReservations:
    def reservations(self) -> list[object]:
        return []


def test_reconciling_one_node_reads_its_row_not_every_nodes_views(
    master: CubeMaster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At startup every node is reconciled once per replica: a full reload for each is O(N²) at 10,000 nodes."""
    from cubeaccel.master.maintenance import reconcile_node

    master.cache.views()
    reads: list[int] = []
    real = master.store.node_views

    def counted(*args: Any, **kwargs: Any) -> tuple[list[NodeView], list[NodeLiveness]]:
        reads.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(master.store, "node_views", counted)
    asked: list[str] = []

    def client(url: str) -> _NoReservations:
        asked.append(url)
        return _NoReservations()

    monkeypatch.setattr(master, "client", client)
    assert reconcile_node(master, "n1") == {"node": "n1", "lost": [], "released_orphans": [], "workload_healed": []}
    assert asked == ["http://127.1.0.2:7"] and reads == []
    assert reconcile_node(master, "nobody") == {"node": "nobody", "skipped": "unknown node"}
