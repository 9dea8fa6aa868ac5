"""The store's group commit: a body that raises rolls back alone, reads see only committed state and never wait
for an open transaction, and a change is visible to everyone once `tx()` has returned."""

from __future__ import annotations

import threading
from pathlib import Path

from cubeaccel.cubelet.store import Store
from cubeaccel.model.states import Actor


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
