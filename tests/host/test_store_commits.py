"""The Cubelet store's transactions: a body that raises rolls back alone, a change is durable and visible to every
thread once `tx()` has returned, reads see only committed state and never wait for an open transaction, and a
commit that fails makes no change and says so."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest

from cubeaccel.cubelet.store import Store
from cubeaccel.model.event_kinds import EventKind
from cubeaccel.model.states import Actor
from cubeaccel.protocol.errors import CubeError

MARK = EventKind.RECONCILE_REPAIR  # any kind: the events are told apart by their reason


def _kinds(store: Store) -> list[str | None]:
    return [e.reason for e in store.events()]


def test_a_body_that_raises_rolls_back_alone(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    with store.tx() as t:
        t.event(MARK, Actor.CUBELET, reason="kept")
    with pytest.raises(RuntimeError), store.tx() as t:
        t.event(MARK, Actor.CUBELET, reason="rolled_back")
        raise RuntimeError("the decision failed")
    assert _kinds(store) == ["kept"]
    store.close()
    assert _kinds(Store(tmp_path / "s.db")) == ["kept"]  # and durable


def test_an_inner_transaction_that_raises_rolls_back_alone_and_the_outer_one_commits(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    with store.tx() as outer:
        outer.event(MARK, Actor.CUBELET, reason="outer")
        with pytest.raises(RuntimeError), store.tx() as inner:
            inner.event(MARK, Actor.CUBELET, reason="inner")
            raise RuntimeError("the inner decision failed")
    assert _kinds(store) == ["outer"]
    store.close()


def test_each_change_is_one_commit_made_before_tx_returns(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    before = store.commits
    for i in range(3):
        with store.tx() as t:
            t.event(MARK, Actor.CUBELET, reason=f"e{i}")
        other = sqlite3.connect(str(tmp_path / "s.db"))  # another process's view of the file
        assert [r[0] for r in other.execute("SELECT reason FROM events ORDER BY seq")] == [
            f"e{j}" for j in range(i + 1)
        ]
        other.close()
    assert store.commits == before + 3
    store.close()


def test_reads_do_not_wait_for_an_open_transaction_and_see_only_committed_state(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    inside, leave = threading.Event(), threading.Event()

    def writer() -> None:
        with store.tx() as t:
            t.event(MARK, Actor.CUBELET, reason="pending")
            inside.set()
            assert leave.wait(10)

    w = threading.Thread(target=writer, daemon=True)
    w.start()
    assert inside.wait(10)
    assert _kinds(store) == []  # returned while the body is open, without its change
    leave.set()
    w.join(10)
    assert not w.is_alive()
    assert _kinds(store) == ["pending"]  # tx() returned: committed and visible to other threads
    store.close()


def test_a_commit_that_fails_makes_no_change_and_says_so(tmp_path: Path) -> None:
    """A COMMIT refused by SQLite (here: a deferred foreign key left dangling, as a full disk would refuse
    it) is `store.commit_failed`, and the next change goes through."""
    store = Store(tmp_path / "s.db")
    store._conn.execute("CREATE TABLE parent (id INTEGER PRIMARY KEY)")
    store._conn.execute("CREATE TABLE child (p INTEGER REFERENCES parent(id) DEFERRABLE INITIALLY DEFERRED)")
    with pytest.raises(CubeError) as e, store.tx() as t:
        t.event(MARK, Actor.CUBELET, reason="lost")
        t.c.execute("INSERT INTO child VALUES (42)")
    assert e.value.code == "store.commit_failed"
    with store.tx() as t:
        t.event(MARK, Actor.CUBELET, reason="next")
    assert _kinds(store) == ["next"]
    store.close()
