"""The placement claim in the store (SQLite here; PostgreSQL in tests/postgres): derived, locked, bounded."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cubeaccel.master.records import SandboxRow
from cubeaccel.master.schema import SCHEMA_VERSION
from cubeaccel.master.store import MasterStore
from cubeaccel.model.sandbox_states import NodeEvent, SandboxActor, SandboxEvent
from tests.support.master_builders import group, heartbeat, sandbox_row

H100 = "H100-PCIe-80GB"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[MasterStore]:
    s = MasterStore(str(tmp_path / "m.db"))
    yield s
    s.close()


def sandbox(sid: str, count: int = 1, **over: Any) -> SandboxRow:
    now = time.time()
    return sandbox_row(sid, now, count=count, **over)


def test_migrations_run_once_and_reopening_keeps_the_version(tmp_path: Path) -> None:
    assert MasterStore(str(tmp_path / "m.db")).schema_version == SCHEMA_VERSION
    assert MasterStore(str(tmp_path / "m.db")).schema_version == SCHEMA_VERSION


def test_claims_are_admitted_only_while_the_summary_minus_claims_has_room(store: MasterStore) -> None:
    store.heartbeat(heartbeat("n", group(H100, 2)), time.time(), 10)
    key = store.all_node_views()[0].groups[0].key
    for sid in ("a", "b", "c"):
        assert store.insert_sandbox(sandbox(sid)) is None
    now = time.time()
    assert store.admit("a", "n", key, 1, now, 10) and store.admit("b", "n", key, 1, now, 10)
    assert not store.admit("c", "n", key, 1, now, 10)
    assert store.all_node_views()[0].admitted == {key: 2}


def test_a_heartbeat_sent_after_the_reservation_absorbs_the_claim(store: MasterStore) -> None:
    store.heartbeat(heartbeat("n", group(H100, 2)), time.time(), 10)
    key = store.all_node_views()[0].groups[0].key
    store.insert_sandbox(sandbox("a"))
    assert store.admit("a", "n", key, 1, time.time(), 10)
    store.update_sandbox(
        "a", "reserved", event=SandboxEvent.READY, by=SandboxActor.PLACEMENT, cubelet_created_at=1500.0
    )
    assert store.all_node_views()[0].admitted == {key: 1}  # the last summary (sent at 1000) cannot show it
    hb = heartbeat("n", group(H100, 2, free=1))
    hb["sent_at"] = 1501.0
    store.heartbeat(hb, time.time(), 10)
    assert store.all_node_views()[0].admitted == {}


def test_no_claim_on_stale_draining_or_unknown_nodes(store: MasterStore) -> None:
    store.heartbeat(heartbeat("n", group(H100, 8)), time.time() - 60, 10)
    key = store.all_node_views()[0].groups[0].key
    store.insert_sandbox(sandbox("a"))
    assert not store.admit("a", "n", key, 1, time.time(), 10)  # stale
    store.heartbeat(heartbeat("n", group(H100, 8)), time.time(), 10)
    store.node_event("n", NodeEvent.DRAIN)
    assert not store.admit("a", "n", key, 1, time.time(), 10)
    assert not store.admit("a", "other", key, 1, time.time(), 10)


def test_duplicate_ids_and_idempotency_keys_return_the_existing_record(store: MasterStore) -> None:
    first = sandbox("a", idempotency_key="k")
    assert store.insert_sandbox(first) is None
    same_id = store.insert_sandbox(sandbox("a"))
    same_key = store.insert_sandbox(sandbox("b", idempotency_key="k"))
    assert same_id is not None and same_key is not None and same_id.id == same_key.id == "a"


def test_heartbeat_reports_return_from_stale(store: MasterStore) -> None:
    assert store.heartbeat(heartbeat("n", group(H100, 1)), 100.0, 10) == ("ready", True)
    assert store.heartbeat(heartbeat("n", group(H100, 1)), 105.0, 10) == ("ready", False)
    assert store.heartbeat(heartbeat("n", group(H100, 1)), 200.0, 10) == ("ready", True)
