"""The store's group commit: a body that raises rolls back alone, reads see only committed state and never wait
for an open transaction, and a change is visible to everyone once `tx()` has returned."""

from __future__ import annotations

import threading
from pathlib import Path

from cubeaccel.cubelet.locks import FairRLock
from cubeaccel.cubelet.store import Store
from cubeaccel.model.states import Actor
from tests.support.poll import poll


def _kinds(store: Store) -> list[str]:
    return [e.kind for e in store.events()]


def test_a_body_that_raises_rolls_back_alone(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    with store.tx(durable=False) as t:
        t.event("kept", Actor.CUBELET)
    try:
        with store.tx(durable=False) as t:
            t.event("rolled_back", Actor.CUBELET)
            raise RuntimeError("the decision failed")
    except RuntimeError:
        pass
    store.flush()
    assert _kinds(store) == ["kept"]
    store.close()
    assert _kinds(Store(tmp_path / "s.db")) == ["kept"]  # and durable


def test_reads_do_not_wait_for_an_open_transaction_and_see_only_committed_state(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    inside, leave = threading.Event(), threading.Event()

    def writer() -> None:
        with store.tx() as t:
            t.event("pending", Actor.CUBELET)
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


def test_a_lone_change_is_committed_on_its_callers_own_thread(tmp_path: Path) -> None:
    """No hand-off to the writer thread when nobody else is committing: the caller leads."""
    store = Store(tmp_path / "s.db")
    commits: list[int] = []
    store._conn.set_trace_callback(lambda sql: commits.append(threading.get_ident()) if sql == "COMMIT" else None)
    for i in range(3):
        with store.tx() as t:
            t.event(f"e{i}", Actor.CUBELET)
    assert commits == [threading.get_ident()] * 3
    store.close()


def test_changes_made_while_a_commit_is_under_way_share_the_next_commit(tmp_path: Path) -> None:
    """Eight callers arrive while a leader is committing: they all join one open batch, wait for it, and
    return together after one commit — none before its change is durable."""
    store = Store(tmp_path / "s.db")
    with store._cv:
        store._leading = True  # as if another caller were committing right now
    returned: list[int] = []

    def change(i: int) -> None:
        with store.tx() as t:
            t.event(f"c{i}", Actor.CUBELET)
        returned.append(i)

    threads = [threading.Thread(target=change, args=(i,), daemon=True) for i in range(8)]
    for th in threads:
        th.start()
    poll(lambda: store._open and len(store._done) == 1, 10, 0.002, what="one batch waited for")
    poll(lambda: _waiters(store) == 8, 10, 0.002, what="eight callers waiting on the batch")
    assert returned == [] and _kinds(store) == []
    before = store.commits
    store._lead()  # the "other caller" finishes: it commits the open batch once and passes the lead on
    for th in threads:
        th.join(10)
    assert sorted(returned) == list(range(8))
    assert store.commits == before + 1
    assert sorted(_kinds(store)) == [f"c{i}" for i in range(8)]
    store.close()


def _waiters(store: Store) -> int:
    with store._cv:
        return sum(len(ev._cond._waiters) for ev in store._done.values())  # type: ignore[attr-defined]


def test_concurrent_decisions_share_commits(tmp_path: Path) -> None:
    """Eight threads making decisions the way the Cubelet does (the lifecycle lock around the transaction, the
    wait for the disk after it): some commits carry several changes. With one commit per change — what a leader
    that commits at once would do — this fails."""
    store = Store(tmp_path / "s.db")
    lifecycle = FairRLock()
    per_thread, n_threads = 40, 8
    before = store.commits

    def decide(w: int) -> None:
        for i in range(per_thread):
            with lifecycle, store.tx(durable=False) as t:
                t.event(f"w{w}-{i}", Actor.CUBELET)
            store.flush()

    threads = [threading.Thread(target=decide, args=(w,)) for w in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    changes = per_thread * n_threads
    assert len(store.events()) == changes  # every change durable and visible
    assert store.commits - before < changes
    store.close()
