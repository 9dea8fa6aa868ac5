"""Issue 19 #4: an idempotent create is one atomic claim that survives refusal and replica races.

A retry (or a twin racing the first) gets the original outcome: the same record once it is placed, or the same
refusal — never a 500 (`UniqueViolation` re-raised after the refusal deleted the row), never 200 `scheduling`
for a sandbox that a refusal then deletes (a phantom), never a second placement.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from cubeaccel.master.records import SandboxRow
from cubeaccel.master.server import create_app
from cubeaccel.master.service import CreateSpec, CubeMaster, MasterConfig
from cubeaccel.master.store import MasterStore
from cubeaccel.model.request import AcceleratorChoice, AcceleratorRequest
from cubeaccel.model.sandbox_states import SandboxActor as SA
from cubeaccel.model.sandbox_states import SandboxEvent as SE
from cubeaccel.model.sandbox_states import SandboxState as SS
from cubeaccel.protocol.errors import CubeError
from tests.support.master_builders import Credentials

REFUSAL = "schedule.placement_failed"


def spec(key: str | None = "k1", sid: str | None = None) -> CreateSpec:
    return CreateSpec(sid, "t", key, None, AcceleratorRequest((AcceleratorChoice("gpu", 1),)), None, 1, None)


class Placement:
    """Stands in for `_place` (the Cubelet round trips): waits for `go`, then refuses or places."""

    def __init__(self, master: CubeMaster, refuse: bool, go: threading.Event | None = None) -> None:
        self.master, self.refuse, self.go = master, refuse, go
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, sid: str, spec: CreateSpec, resolved: Any) -> SandboxRow:
        with self.lock:
            self.calls += 1
        if self.go is not None:
            assert self.go.wait(10)
        if self.refuse:
            raise CubeError(REFUSAL, "every node refused", "scheduler", {"attempts": []}, 409)
        row = self.master.store.sandbox(sid)
        assert row is not None
        return row


def replica(url: str) -> CubeMaster:
    m = CubeMaster(MasterStore(url), MasterConfig(cubelet_timeout_s=5.0))
    m.resolve = lambda spec: []  # type: ignore[method-assign]
    return m


@pytest.fixture
def db(tmp_path: Path) -> Iterator[str]:
    yield str(tmp_path / "m.db")


def outcome(fn: Callable[[], tuple[SandboxRow, bool]]) -> str:
    try:
        row, _ = fn()
    except CubeError as e:
        return e.code
    return f"row:{row.id}"


def test_a_twin_of_a_create_that_is_then_refused_gets_the_refusal_not_a_phantom(db: str) -> None:
    m = replica(db)
    go = threading.Event()
    m._place = Placement(m, refuse=True, go=go)  # type: ignore[method-assign]
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(outcome, lambda: m.create(spec()))
        deadline = time.monotonic() + 10
        while m.store.sandboxes() == [] and time.monotonic() < deadline:
            time.sleep(0.01)
        twin = pool.submit(outcome, lambda: m.create(spec()))
        time.sleep(0.2)  # the twin is waiting on the first create's outcome, not answering 200 scheduling
        assert not twin.done()
        go.set()
        assert first.result(10) == REFUSAL and twin.result(10) == REFUSAL
    assert m.store.sandboxes() == []
    # a later retry replays the refusal: no second placement, no 500
    with pytest.raises(CubeError) as err:
        m.create(spec())
    assert err.value.code == REFUSAL and err.value.status == 409 and err.value.details["replayed"] is True
    assert m._place.calls == 1


def test_a_retry_of_a_placed_create_gets_its_record(db: str) -> None:
    m = replica(db)
    m._place = Placement(m, refuse=False)  # type: ignore[method-assign]
    row, created = m.create(spec())
    again, created_again = m.create(spec())
    assert created and not created_again and again.id == row.id
    with pytest.raises(CubeError) as err:
        m.create(CreateSpec(None, "t", "k1", None, AcceleratorRequest((AcceleratorChoice("gpu", 2),)), None, 1, None))
    assert err.value.code == "sandbox.conflict"


def test_a_create_that_dies_of_a_non_refusal_frees_its_key(db: str) -> None:
    m = replica(db)

    def crash(sid: str, spec: CreateSpec, resolved: Any) -> SandboxRow:
        raise RuntimeError("boom")

    m._place = crash  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        m.create(spec())
    m._place = Placement(m, refuse=False)  # type: ignore[method-assign]
    row, created = m.create(spec())
    assert created and row.idempotency_key == "k1"


def race(url: str, keys: int = 12, per_key: int = 6) -> None:
    """Two replicas on one database, every key sent `per_key` times at once, half the keys refused: every
    caller of a key gets the same outcome, each key is placed once, no other error escapes."""
    a, b = replica(url), replica(url)
    placements: dict[str, int] = {}
    lock = threading.Lock()

    def place_for(m: CubeMaster) -> Callable[..., SandboxRow]:
        def place(sid: str, s: CreateSpec, resolved: Any) -> SandboxRow:
            with lock:
                placements[str(s.idempotency_key)] = placements.get(str(s.idempotency_key), 0) + 1
            time.sleep(0.02)
            if int(str(s.idempotency_key).split("-")[1]) % 2:
                raise CubeError(REFUSAL, "every node refused", "scheduler", {}, 409)
            # Placed, as a real placement leaves it: out of the placement states, so twins take its record
            # (a row left `scheduling` has twins wait until it looks abandoned — a race with their own deadline).
            assert m.store.update_sandbox(sid, "claimed", event=SE.CLAIM, by=SA.PLACEMENT)
            assert m.store.update_sandbox(sid, "reserved", expect=(SS.PLACING,), event=SE.READY, by=SA.PLACEMENT)
            row = m.store.sandbox(sid)
            assert row is not None
            return row

        return place

    a._place = place_for(a)  # type: ignore[method-assign]
    b._place = place_for(b)  # type: ignore[method-assign]
    jobs = [(k, (a, b)[i % 2]) for k in range(keys) for i in range(per_key)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda j: (j[0], outcome(lambda: j[1].create(spec(f"key-{j[0]}")))), jobs))
    by_key: dict[int, set[str]] = {}
    for k, r in results:
        by_key.setdefault(k, set()).add(r)
    for k, seen in by_key.items():
        assert len(seen) == 1, (k, seen)
        (only,) = seen
        assert only == REFUSAL if k % 2 else only.startswith("row:"), (k, only)
    assert all(n == 1 for n in placements.values()), placements
    assert len(a.store.sandboxes()) == keys // 2


def test_two_replicas_racing_on_sqlite_agree_on_every_outcome(db: str) -> None:
    race(db)


def test_the_idempotency_key_header_is_length_limited(db: str) -> None:
    master = replica(db)
    api = TestClient(create_app(master), raise_server_exceptions=False)
    api.auth = Credentials(master)
    r = api.post("/v1/sandboxes", json={"tenant": "t", "gpu": "H100:1"}, headers={"Idempotency-Key": "k" * 10000})
    assert r.status_code == 422 and r.json()["error"]["code"] == "request.invalid_idempotency_key"
    assert api.get("/v1/sandboxes").json()["sandboxes"] == []
