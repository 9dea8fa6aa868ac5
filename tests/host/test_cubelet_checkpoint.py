"""The reservation checkpoint: typed, versioned, and migration 6 converts the old `facts` rows (real SQLite)."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cubeaccel.cubelet.lifecycle import ReservationRequest
from cubeaccel.cubelet.schema import MIGRATIONS
from cubeaccel.cubelet.store import Store
from cubeaccel.model.checkpoint import (
    CHECKPOINT_VERSION,
    UNREAD_FACTS,
    ReservationCheckpoint,
    SandboxFailure,
)
from cubeaccel.model.reservation_states import ReservationPhase
from cubeaccel.model.states import DeviceState
from cubeaccel.protocol.errors import CubeError
from tests.support.cubelet_harness import Node

S, P = DeviceState, ReservationPhase


def _v5_store(path: Path) -> sqlite3.Connection:
    """A journal as cubeaccel wrote it at schema 5 (reservations with a free-form `facts` column)."""
    conn = sqlite3.connect(path, isolation_level=None)
    for v in range(1, 6):
        step = MIGRATIONS[v]
        assert isinstance(step, str)
        conn.executescript(step)
    conn.execute("PRAGMA user_version=5")
    return conn


def _insert_old(conn: sqlite3.Connection, sandbox_id: str, phase: str, facts: dict[str, Any] | str) -> None:
    conn.execute(
        "INSERT INTO reservations (sandbox_id,params,device_ids,phase,created_at,expires_at,facts,releasing_since)"
        " VALUES (?,?,?,?,?,?,?,?)",
        (sandbox_id, "{}", "[]", phase, 1.0, None, facts if isinstance(facts, str) else json.dumps(facts), None),
    )


# Every key the old writers used: the 12 that decisions read, and the 4 that nothing read.
OLD_RELEASING = {
    "shim_started": True,
    "started_at": 10.0,
    "start_id": "0123456789abcdef",
    "image_digest": "sha256:" + "b" * 64,
    "vmm_pid": 4242,
    "guest_addresses": {"dev-a": "0000:00:05.0"},
    "detached": ["dev-a"],
    "shim_exited": True,
    "failure": {"code": "vmm_exited", "layer": "cubelet", "message": "the VMM exited", "phase": "running"},
    "kill_at": 50.0,
    "vmm_survives": True,
    "release_waits": {"dev-a": ["release.vmm_not_exited"]},
    "running_at": 20.0,
    "vmm_exited": True,
    "detach_timeout": True,
    "release_reason": "vmm_exited",
}


def test_migration_6_converts_old_facts_rows_and_drops_the_unread_keys(tmp_path: Path) -> None:
    conn = _v5_store(tmp_path / "c.db")
    _insert_old(conn, "sb-old", "releasing", OLD_RELEASING)
    _insert_old(conn, "sb-new", "reserved", {})
    _insert_old(conn, "sb-odd-pid", "starting", {"shim_started": True, "vmm_pid": "4242"})
    conn.close()

    store = Store(tmp_path / "c.db")
    assert store.schema_version == 6
    old = store.reservation("sb-old")
    assert old is not None and old.phase is P.RELEASING
    assert old.checkpoint == ReservationCheckpoint(
        shim_started=True,
        started_at=10.0,
        start_id="0123456789abcdef",
        image_digest="sha256:" + "b" * 64,
        vmm_pid=4242,
        guest_addresses={"dev-a": "0000:00:05.0"},
        detached=["dev-a"],
        shim_exited=True,
        failure=SandboxFailure("vmm_exited", "cubelet", "the VMM exited", "running"),
        kill_at=50.0,
        vmm_survives=True,
        release_waits={"dev-a": ["release.vmm_not_exited"]},
    )
    assert not set(UNREAD_FACTS) & set(old.checkpoint.to_json())
    assert store.reservation("sb-new").checkpoint == ReservationCheckpoint()  # type: ignore[union-attr]
    assert store.reservation("sb-odd-pid").checkpoint.vmm_pid is None  # type: ignore[union-attr]
    store.close()
    columns = {r[1] for r in sqlite3.connect(tmp_path / "c.db").execute("PRAGMA table_info(reservations)")}
    assert "checkpoint" in columns and "facts" not in columns


def test_a_row_that_does_not_convert_stops_the_migration_and_changes_nothing(tmp_path: Path) -> None:
    conn = _v5_store(tmp_path / "c.db")
    _insert_old(conn, "sb-ok", "reserved", {})
    _insert_old(conn, "sb-bad", "starting", {"shim_started": "yes"})
    conn.close()
    with pytest.raises(CubeError) as err:
        Store(tmp_path / "c.db")
    assert err.value.code == "store.migration_failed" and err.value.details["sandbox_id"] == "sb-bad"
    conn = sqlite3.connect(tmp_path / "c.db")
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 5
    assert conn.execute("SELECT facts FROM reservations WHERE sandbox_id='sb-bad'").fetchone()[0] == (
        '{"shim_started": "yes"}'
    )


def test_a_running_sandbox_recorded_at_schema_5_survives_the_upgrade_and_releases(tmp_path: Path) -> None:
    """The Cubelet is upgraded under a running sandbox: after migration and reconcile it is still running, its
    shim's reports still match the start id, and a delete still brings the devices back."""
    node = Node.create(tmp_path)
    res = node.cubelet.reserve("sb", ReservationRequest(count=2))
    node.cubelet.start("sb")
    running = node.cubelet.store.reservation("sb")
    assert running is not None and running.phase is P.RUNNING
    cp = running.checkpoint
    old_facts = {  # what the schema-5 code wrote for this sandbox
        "shim_started": True,
        "started_at": cp.started_at,
        "start_id": cp.start_id,
        "image_digest": cp.image_digest,
        "vmm_pid": cp.vmm_pid,
        "guest_addresses": cp.guest_addresses,
        "running_at": cp.started_at,
    }
    node.cubelet.store.close()
    conn = sqlite3.connect(tmp_path / "cubelet.db", isolation_level=None)
    conn.execute("ALTER TABLE reservations ADD COLUMN facts TEXT NOT NULL DEFAULT '{}'")
    conn.execute("UPDATE reservations SET facts=? WHERE sandbox_id='sb'", (json.dumps(old_facts),))
    conn.execute("ALTER TABLE reservations DROP COLUMN checkpoint")
    conn.execute("PRAGMA user_version=5")
    conn.close()

    assert node.restart() == []  # nothing to repair: the same sandbox, the same VMM
    after = node.cubelet.store.reservation("sb")
    # schema 5 predates workload tokens: the same record, without a token hash
    assert (
        after is not None and after.phase is P.RUNNING and after.checkpoint == replace(cp, workload_token_sha256=None)
    )
    assert node.cubelet.store.schema_version == 6
    assert {node.device(d).state for d in res.device_ids} == {S.ATTACHED}
    node.cubelet.release("sb")
    assert node.cubelet.store.reservation("sb") is None
    assert {node.device(d).state for d in res.device_ids} == {S.ALLOCATABLE}


def test_the_checkpoint_of_a_full_cycle_holds_only_fields_a_decision_reads(tmp_path: Path) -> None:
    node = Node.create(tmp_path)
    node.cubelet.reserve("sb", ReservationRequest(count=1))
    node.cubelet.start("sb")
    node.cubelet.release("sb")
    closed = [e for e in node.cubelet.store.events(sandbox_id="sb") if e.kind == "reservation_closed"]
    facts = closed[-1].details["facts"]
    assert facts["v"] == CHECKPOINT_VERSION and facts["shim_started"] is True and facts["shim_exited"] is True
    assert not set(UNREAD_FACTS) & set(facts)
    assert ReservationCheckpoint.from_json(facts).start_id == facts["start_id"]


text = st.text(max_size=12)
checkpoints = st.builds(
    ReservationCheckpoint,
    shim_started=st.booleans(),
    started_at=st.none() | st.floats(allow_nan=False, allow_infinity=False),
    start_id=st.none() | text,
    image_digest=st.none() | text,
    vmm_pid=st.none() | st.integers(1, 2**22),
    guest_addresses=st.dictionaries(text, text, max_size=3),
    detached=st.lists(text, max_size=3),
    shim_exited=st.booleans(),
    failure=st.none() | st.builds(SandboxFailure, code=text, layer=text, message=text, phase=text),
    kill_at=st.none() | st.floats(allow_nan=False, allow_infinity=False),
    vmm_survives=st.booleans(),
    release_waits=st.dictionaries(text, st.lists(text, max_size=2), max_size=3),
)


@given(checkpoints)
def test_a_checkpoint_survives_its_json(cp: ReservationCheckpoint) -> None:
    assert ReservationCheckpoint.from_json(json.loads(json.dumps(cp.to_json()))) == cp


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"v": 1, "shim_started": 1}, "shim_started"),
        ({"v": 1, "vmm_pid": True}, "vmm_pid"),
        ({"v": 1, "detached": "dev-a"}, "detached"),
        ({"v": 1, "failure": {"code": "x"}}, "failure"),
        ({"v": 1, "running_at": 1.0}, "unknown checkpoint fields"),
        ({"shim_started": True}, "version"),
        ([], "object"),
    ],
)
def test_a_malformed_checkpoint_is_refused(data: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ReservationCheckpoint.from_json(data)


def test_a_checkpoint_from_a_newer_cubeaccel_is_refused() -> None:
    with pytest.raises(CubeError) as err:
        ReservationCheckpoint.from_json({"v": CHECKPOINT_VERSION + 1})
    assert err.value.code == "store.checkpoint_too_new"
