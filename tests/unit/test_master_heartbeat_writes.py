"""A heartbeat that repeats its node's summary writes only the clocks, and a replica's node cache re-parses only
the nodes whose summary changed: at 10,000 nodes every beat rewrote a ~1.7 KB JSON row and every reload re-parsed
each node that beat since the last one. Counted in statements and parses, not timed."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from cubeaccel.master import store as store_module
from cubeaccel.master import view as view_module
from cubeaccel.master.cache import NodeCache
from cubeaccel.master.server import create_app
from cubeaccel.master.service import CubeMaster, MasterConfig
from cubeaccel.master.store import MasterStore, NodeLiveness
from cubeaccel.master.view import NodeView
from tests.support.master_builders import Credentials, group, heartbeat

H100 = "H100-PCIe-80GB"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[MasterStore]:
    s = MasterStore(str(tmp_path / "m.db"))
    yield s
    s.close()


def beat(node: str, sent_at: float, free: int = 8) -> dict[str, Any]:
    body = heartbeat(node, group(H100, 8, free=free))
    body["sent_at"] = sent_at
    return body


def node_updates(store: MasterStore) -> list[str]:
    """The UPDATE statements on `nodes` the store runs from now on."""
    seen: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        if statement.lstrip().upper().startswith("UPDATE NODES"):
            seen.append(statement)

    sa.event.listen(store.engine, "before_cursor_execute", record)
    return seen


def test_a_beat_repeating_the_summary_writes_only_the_clocks_and_the_views_see_them(store: MasterStore) -> None:
    store.heartbeat(beat("n", 1000.0), 5000.0, 10)
    updates = node_updates(store)
    store.heartbeat(beat("n", 1002.0), 5002.0, 10)
    assert len(updates) == 1
    assert "heartbeat" not in updates[0].split("WHERE")[0]  # the JSON summary is not rewritten
    (view,) = store.all_node_views()
    assert (view.received_at, view.sent_at) == (5002.0, 1002.0)  # the clocks come from the columns
    (row,) = store.node_views()[1]
    assert (row.received_at, row.sent_at) == (5002.0, 1002.0)


def test_a_beat_with_a_changed_summary_rewrites_it(store: MasterStore) -> None:
    store.heartbeat(beat("n", 1000.0), 5000.0, 10)
    updates = node_updates(store)
    store.heartbeat(beat("n", 1002.0, free=7), 5002.0, 10)
    assert len(updates) == 1 and "heartbeat" in updates[0].split("WHERE")[0]
    (view,) = store.all_node_views()
    assert (view.free(view.groups[0]), view.sent_at) == (7, 1002.0)


def test_a_row_written_before_digests_is_rewritten_by_its_next_beat(store: MasterStore) -> None:
    store.heartbeat(beat("n", 1000.0), 5000.0, 10)
    with store.tx() as c:  # as a database migrated from before the digest column holds it
        c.execute(sa.text("UPDATE nodes SET summary_digest = NULL"))
    updates = node_updates(store)
    store.heartbeat(beat("n", 1002.0), 5002.0, 10)
    assert len(updates) == 1 and "heartbeat" in updates[0].split("WHERE")[0]
    assert store.node_views()[1][0].digest is not None


def test_a_replica_reparses_only_the_nodes_whose_summary_changed(
    store: MasterStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    nodes = [f"n{i}" for i in range(20)]
    for name in nodes:
        store.heartbeat(beat(name, 1000.0), 5000.0, 10)
    cache = NodeCache(store)
    before = {v.name: v for v in cache.views(fresh=True)}
    for name in nodes:  # one round of beats: one node's summary changed, the others repeat theirs
        store.heartbeat(beat(name, 1002.0, free=7 if name == "n3" else 8), 5002.0, 10)

    parsed: list[str] = []
    parse = view_module.view_from_heartbeat

    def counting(body: Any, *args: Any, **kwargs: Any) -> NodeView:
        parsed.append(str(body["node"]))
        return parse(body, *args, **kwargs)

    monkeypatch.setattr(store_module, "view_from_heartbeat", counting)
    after = {v.name: v for v in cache.views(fresh=True)}
    assert parsed == ["n3"]
    assert all(after[n] is before[n] for n in nodes if n != "n3")  # memos kept
    assert {(v.received_at, v.sent_at) for v in after.values()} == {(5002.0, 1002.0)}
    assert after["n3"].free(after["n3"].groups[0]) == 7


def test_lookups_and_decisions_do_not_wait_for_a_reload_reading_the_store(
    store: MasterStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reload's reads take 84 to 300 ms at 10,000 nodes; decisions and lookups must not queue behind them."""
    store.heartbeat(beat("n", 1000.0), 5000.0, 10)
    cache = NodeCache(store, ttl_s=0.0)  # every call is past the TTL
    cache.views()
    reading, release = threading.Event(), threading.Event()
    read = store.node_views

    def slow_read(*args: Any, **kwargs: Any) -> tuple[list[NodeView], list[NodeLiveness]]:
        reading.set()
        assert release.wait(30), "the test never released the reload"
        return read(*args, **kwargs)

    monkeypatch.setattr(store, "node_views", slow_read)
    reloader = threading.Thread(target=cache.views, daemon=True)
    reloader.start()
    try:
        assert reading.wait(10)
        answered: list[object] = []

        def lookups() -> None:
            answered.append(cache.view("n"))
            answered.append(cache.node_at("http://127.0.0.1:1"))
            answered.append(len(cache.views()))
            cache.note_admitted("n", cache.views()[0].groups[0].key, 1)

        other = threading.Thread(target=lookups, daemon=True)
        other.start()
        other.join(timeout=10)
        assert not other.is_alive(), "a lookup waited for the reload's store reads"
        assert answered[1:] == ["n", 1]
    finally:
        release.set()
        reloader.join(timeout=30)
    assert not reloader.is_alive()
    view = cache.view("n")  # the reloader's merge, not another reload
    # the claim noted while the reload read is not lost by its merge (the store holds no claim row for it)
    assert view is not None and view.free(view.groups[0]) == 7


def test_a_node_appearing_or_coming_back_is_taken_in_from_its_row_not_by_a_reload_of_every_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At 10,000 nodes, nodes came back from stale by the hundred per second, and each forced a reload of all."""
    master = CubeMaster(MasterStore(str(tmp_path / "api.db")), MasterConfig(staleness_s=10.0))
    try:
        api = TestClient(create_app(master), raise_server_exceptions=False)
        api.auth = Credentials(master)
        for i in range(5):
            assert api.put(f"/v1/nodes/n{i}", json=beat(f"n{i}", 1000.0)).status_code == 200
        master.cache.ttl_s = 3600.0  # only an invalidation would make the copy reload from here
        master.cache.views()
        full_reads: list[int] = []
        read = master.store.node_views

        def counted(*args: Any, **kwargs: Any) -> tuple[list[NodeView], list[NodeLiveness]]:
            full_reads.append(1)
            return read(*args, **kwargs)

        monkeypatch.setattr(master.store, "node_views", counted)
        assert api.put("/v1/nodes/n9", json=beat("n9", 1000.0)).status_code == 200  # a new node
        view = master.cache.view("n9")
        assert view is not None and view.free(view.groups[0]) == 8
        assert sorted(v.name for v in master.cache.views()) == ["n0", "n1", "n2", "n3", "n4", "n9"]
        assert full_reads == []
    finally:
        master.store.close()


def test_a_node_back_from_stale_with_its_summary_unchanged_is_taken_in_without_a_read(
    store: MasterStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When CubeMaster cannot take every beat, nearly every beat is a return from stale: none may cost a read."""
    store.heartbeat(beat("n", 1000.0), 5000.0, 10)
    cache = NodeCache(store, ttl_s=3600.0)
    cache.views()
    reads: list[str] = []
    read = store.node_view

    def counted(name: str) -> NodeView | None:
        reads.append(name)
        return read(name)

    monkeypatch.setattr(store, "node_view", counted)
    cache.heard(store.record_heartbeat(beat("n", 1100.0), 5100.0, 10))  # stale for 100 s, same summary
    view = cache.view("n")
    assert reads == [] and view is not None and (view.received_at, view.sent_at) == (5100.0, 1100.0)
    cache.heard(store.record_heartbeat(beat("n", 1200.0, free=3), 5200.0, 10))  # back with a new summary
    view = cache.view("n")
    assert reads == ["n"] and view is not None and view.free(view.groups[0]) == 3
