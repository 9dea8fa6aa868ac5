"""CubeMaster's typed records keep the store's JSON and the replies byte for byte (SQLite; tests/postgres for PG)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from cubeaccel.master import schema as S
from cubeaccel.master.records import Quota, Refusal, SandboxChange, SandboxRow
from cubeaccel.master.service import sandbox_record
from cubeaccel.master.store import MasterStore
from cubeaccel.model.sandbox_states import SandboxActor, SandboxEvent, SandboxState
from cubeaccel.protocol.errors import CubeError
from cubeaccel.wire import master_api as W
from tests.support.stored_rows import (
    normalized_requests,
    old_create_row,
    old_insert,
    old_record,
    raw_rows,
    reply_bytes,
)

_ids = itertools.count()


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[tuple[MasterStore, MasterStore]]:
    old, new = MasterStore(str(tmp_path / "old.db")), MasterStore(str(tmp_path / "new.db"))
    yield old, new
    old.close()
    new.close()


def new_create_row(sid: str, request: dict[str, Any], now: float, key: str | None, count: int) -> SandboxRow:
    """The row `CubeMaster.create` builds now."""
    return SandboxRow(
        id=sid,
        tenant="t",
        idempotency_key=key,
        request=W.SandboxRequest.model_validate(request),
        state=SandboxState.SCHEDULING,
        count=count,
        timeline=(W.TimelineEntry(at=now, phase="requested"),),
        created_at=now,
        updated_at=now,
        expires_at=now + 3600.0,
    )


def assert_creates_store_the_same(old: MasterStore, new: MasterStore, request: dict[str, Any], keyed: bool) -> None:
    n = next(_ids)
    sid, now, key = f"sb-{n}", time.time(), f"k-{n}" if keyed else None
    old_insert(old, old_create_row(sid, request, now, key, 1))
    assert new.insert_sandbox(new_create_row(sid, request, now, key, 1)) is None
    for table in (S.sandboxes, S.idempotency):
        assert raw_rows(new, table) == raw_rows(old, table)
    stored = new.sandbox(sid)
    assert stored is not None and stored.request_json() == request  # what an idempotent repeat compares


def test_a_create_row_is_stored_as_the_dict_based_code_stored_it(stores: tuple[MasterStore, MasterStore]) -> None:
    old, new = stores

    @settings(max_examples=150, deadline=None)
    @given(request=normalized_requests(), keyed=st.booleans())
    def check(request: dict[str, Any], keyed: bool) -> None:
        assert_creates_store_the_same(old, new, request, keyed)

    check()


def test_an_empty_json_column_stays_sql_null(stores: tuple[MasterStore, MasterStore]) -> None:
    _, new = stores
    new.insert_sandbox(new_create_row("sb-null", {}, 1.0, None, 0))
    with new.tx() as c:
        row = c.exec_driver_sql("SELECT contract IS NULL, error IS NULL FROM sandboxes WHERE id = 'sb-null'").one()
    assert tuple(row) == (1, 1)  # not the JSON text `null`


NOW = 1_700_000_000.25
CONTRACT = {"template": {"name": "edu", "version": "1", "digest": "sha256:ab"}, "accel_class": "gpu"}
STORED: list[dict[str, Any]] = [  # rows the dict-based code wrote, in each state a row reaches
    {
        "state": "running",
        "node": "n1",
        "group_key": "gpu|model=H100",
        "accel_class": "gpu",
        "template_name": "edu",
        "template_version": "1",
        "contract": CONTRACT,
        "device_ids": ["0000:17:00.0"],
        "cubelet_created_at": NOW + 1,
        "timeline": [
            {"at": NOW, "phase": "requested"},
            {"at": NOW, "phase": "path", "path": "cold", "reason": "no_pool", "refilling": {}},
            {"at": NOW, "phase": "scheduled", "node": "n1", "decision_ms": 0.5, "score": 3, "numa": "0"},
            {"at": NOW, "phase": "reserved", "node": "n1", "cubelet_timeline": [{"at": NOW, "kind": "x"}]},
        ],
        "request": {
            "template": "edu",
            "accelerators": [{"class": "gpu", "count": 1}],
            "memory_mib": None,
            "vcpus": 1,
            "timeout_s": None,
            "metadata": {"a": "b"},
        },
    },
    {
        "state": "failed",
        "node": "n1",
        "error": {
            "code": "shim.validation_failed",
            "layer": "guest",
            "message": "m",
            "phase": "starting",
            "node": "n1",
        },
        "warm_id": "warm-1",
    },
    {
        "state": "lost",
        "node": "n2",
        "error": {"code": "sandbox.lost", "layer": "cubelet", "message": "m", "node": "n2"},
    },
    {"state": "deleting", "node": "n1", "error": {"code": "cubelet.unreachable", "message": "timed out"}},
    {"state": "deleted", "template_name": "edu", "template_version": "1", "contract": {}, "expires_at": None},
    {"state": "scheduling", "request": {}, "timeline": []},
]


@pytest.mark.parametrize("over", STORED, ids=[r["state"] for r in STORED])
def test_a_row_the_dict_based_code_wrote_is_read_and_shown_the_same(
    stores: tuple[MasterStore, MasterStore], over: dict[str, Any]
) -> None:
    assert_read_and_shown_the_same(stores[0], over)


def assert_read_and_shown_the_same(old: MasterStore, over: dict[str, Any]) -> None:
    sid = f"sb-{over['state']}"
    row = {**old_create_row(sid, {"accelerators": [{"class": "gpu", "count": 1}]}, NOW, None, 1), **over}
    with old.tx() as c:
        c.execute(S.sandboxes.insert().values(**row))
        columns = dict(c.execute(S.sandboxes.select().where(S.sandboxes.c.id == sid)).one()._mapping)
    typed = old.sandbox(sid)
    assert typed is not None and typed.state is SandboxState(over["state"])
    assert reply_bytes(sandbox_record(typed, W.Sandbox)) == reply_bytes(old_record(columns))
    written = typed.columns()  # what inserting it again would write: the same columns, NULLs left to the table
    assert {k: v for k, v in columns.items() if v is not None} == {k: v for k, v in written.items() if v is not None}


def test_a_refusal_is_kept_as_the_cubeerror_it_was(stores: tuple[MasterStore, MasterStore]) -> None:
    old, new = stores
    e = CubeError("quota.sandboxes", "tenant t may hold 1", "scheduler", {"limit": 1, "in_use": 1}, 429)
    assert Refusal.of(e).to_json() == e.to_json()["error"]
    for store in (old, new):
        old_insert(store, old_create_row("sb-r", {"vcpus": 1}, NOW, "k", 1))
    with old.tx() as c:  # the dict-based refuse_create
        c.execute(S.sandboxes.delete().where(S.sandboxes.c.id == "sb-r"))
        c.execute(S.idempotency.update().values(refusal=e.to_json()["error"]))
    new.refuse_create("sb-r", Refusal.of(e))
    assert raw_rows(new, S.idempotency) == raw_rows(old, S.idempotency)
    record = new.idempotency_record("t", "k")
    assert record is not None and record.refusal is not None
    replayed = record.refusal.replayed()
    assert (replayed.code, replayed.status, replayed.details) == (
        "quota.sandboxes",
        429,
        {**e.details, "replayed": True},
    )


def test_a_state_change_reaches_listeners_as_the_record_it_logged(stores: tuple[MasterStore, MasterStore]) -> None:
    _, store = stores
    seen: list[SandboxChange] = []
    store.listeners.append(seen.append)
    store.insert_sandbox(new_create_row("sb-l", {}, NOW, None, 1))
    assert store.update_sandbox("sb-l", "deleted", event=SandboxEvent.DELETE, by=SandboxActor.USER)
    assert [c.to_json() for c in seen] == [
        {
            "sandbox_id": "sb-l",
            "event": "delete",
            "actor": "user",
            "from_state": "scheduling",
            "to_state": seen[0].to_state,
            "phase": "deleted",
        }
    ]


def test_a_quota_reads_what_the_tenant_row_holds() -> None:
    q = Quota(2, {"gpu": 4}, 1024, 3600.0, None)
    assert Quota.from_json(q.to_json()) == q and Quota.from_json({}) == Quota()


def test_a_malformed_stored_column_is_refused_at_read_naming_it(stores: tuple[MasterStore, MasterStore]) -> None:
    old, _ = stores
    row = {**old_create_row("sb-bad", {}, NOW, None, 1), "error": {"code": ["not", "a", "code"]}}
    with old.tx() as c:
        c.execute(S.sandboxes.insert().values(**row))
    with pytest.raises(ValidationError, match="SandboxError"):
        old.sandbox("sb-bad")
