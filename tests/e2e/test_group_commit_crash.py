"""Group commit under SIGKILL: 16 clients change state concurrently (so commits carry several changes each),
the real Cubelet process is killed in the middle, and the store on disk must hold every acknowledged change and
nothing that was never asked for, each change whole (a reservation with exactly its reserved devices, or none).
"""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path

from cubeaccel.transport.cubelet_client import CubeletClient
from tests.support.cubelet_process import CubeletProcess
from tests.support.poll import poll

CLIENTS = 16


def test_sigkill_mid_batch_loses_no_acknowledged_change_and_applies_no_unasked_one(tmp_path: Path) -> None:
    run = tmp_path.name[-8:].replace("_", "-")  # ids unique to this run
    p = CubeletProcess(tmp_path, f"h100x{2 * CLIENTS}", "--pinnable-memory-mib", str(1 << 30)).start()
    sent: set[str] = set()  # reserve requests sent (acknowledged or not)
    reserved: set[str] = set()  # acknowledged reservations not released by an acknowledged delete
    released: set[str] = set()  # acknowledged releases
    releasing: set[str] = set()  # releases sent (acknowledged or not)
    lock = threading.Lock()
    stop = threading.Event()

    def client(w: int) -> None:
        c = CubeletClient(socket=tmp_path / "cubelet.sock", timeout=10)
        i = 0
        try:
            while not stop.is_set():
                sid = f"gc-{run}-{w}-{i}"
                i += 1
                with lock:
                    sent.add(sid)
                c.reserve(sid, 1)
                with lock:
                    reserved.add(sid)
                if i % 2:  # every other one is released: both kinds of change are in flight
                    with lock:
                        releasing.add(sid)
                    out = c.release(sid)
                    if out.released:
                        with lock:
                            reserved.discard(sid)
                            released.add(sid)
        except Exception:  # the server died under us: whatever was in flight is unacknowledged
            return
        finally:
            c.close()

    threads = [threading.Thread(target=client, args=(w,), daemon=True) for w in range(CLIENTS)]
    try:
        for t in threads:
            t.start()
        poll(lambda: len(reserved) + len(released) >= 60, deadline_s=60)
        p.sigkill()  # with 16 clients mid-request: some changes are in an open batch, uncommitted
    finally:
        stop.set()
        for t in threads:
            t.join(20)
        p.stop()
    assert not any(t.is_alive() for t in threads)

    db = sqlite3.connect(f"file:{tmp_path / 'cubelet.db'}?mode=ro", uri=True)
    created = {r[0] for r in db.execute("SELECT sandbox_id FROM events WHERE kind='reservation_created'")}
    closed = {r[0] for r in db.execute("SELECT sandbox_id FROM events WHERE kind='reservation_closed'")}
    rows = dict(db.execute("SELECT sandbox_id, device_ids FROM reservations").fetchall())
    releasing_rows = {r[0] for r in db.execute("SELECT sandbox_id FROM reservations WHERE phase='releasing'")}
    devices = db.execute("SELECT id, state, sandbox_id FROM devices").fetchall()
    db.close()

    assert reserved and released
    assert reserved | released <= created  # no acknowledged reservation lost
    assert released <= closed and not released & rows.keys()  # no acknowledged release undone
    assert reserved - releasing <= rows.keys()
    assert all(sid in rows or sid in closed for sid in reserved & releasing)  # a release in flight: either
    assert created <= sent  # nothing applied that nobody asked for
    # Each change whole: a device is held exactly by the reservation that lists it, and free otherwise.
    holders = {sid: set(json.loads(ids)) for sid, ids in rows.items()}
    for dev_id, state, sid in devices:
        if state == "allocatable":  # free; at most still listed by a release that had not closed yet
            assert sid is None
            assert all(s in releasing_rows for s, ids in holders.items() if dev_id in ids), dev_id
        else:
            assert state in ("reserved", "releasing", "released") and dev_id in holders.get(sid, set()), (dev_id, state)
    assert all(len(ids) == 1 for ids in holders.values())

    p.start()  # and the restarted Cubelet serves again on that store
    assert p.client.health().status == "ok"
    p.stop()
