"""The audit log's chain and its seal: an edited, removed or reordered line, and a cut-off tail (the last
lines removed, which leaves a perfectly valid shorter chain) are all found."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cubeaccel.host.service.audit import AuditLog, head_path, log_id, read_head, verify
from cubeaccel.master.auth import DatabaseSeal, audit_seals
from cubeaccel.master.store import MasterStore
from tests.support.poll import poll


def written(tmp_path: Path, n: int, **kw: Any) -> tuple[AuditLog, list[str]]:
    log = AuditLog(tmp_path / "audit.jsonl", **kw)
    for i in range(n):
        log.append("sandbox:create", "tenant:t/1", "ok", target=f"/v1/sandboxes/s{i}")
    return log, log.path.read_text().splitlines()


def test_an_intact_log_verifies_and_its_head_is_sealed_owner_only(tmp_path: Path) -> None:
    log, lines = written(tmp_path, 5)
    assert verify(log.path) == []
    head = read_head(head_path(log.path))
    assert head is not None and head["seq"] == 5 and head["hash"] == json.loads(lines[-1])["hash"]
    assert head["log"] == log_id(log.path) == json.loads(lines[0])["hash"]
    assert head_path(log.path).stat().st_mode & 0o777 == 0o600


def test_the_database_seal_keeps_the_newest_head_of_each_log(tmp_path: Path) -> None:
    store = MasterStore(str(tmp_path / "m.db"))
    seal = DatabaseSeal(store)
    log, lines = written(tmp_path, 5, sealers=[seal])
    seal(log_id(log.path) or "", 2, "an older head arriving late")  # never moves the seal back
    assert seal.flush()
    [held] = audit_seals(store)
    assert (held["seq"], held["hash"]) == (5, json.loads(lines[-1])["hash"])
    assert str(log_id(log.path)).startswith(held["log"])
    log.path.write_text("\n".join(lines[:3]) + "\n")
    head_path(log.path).unlink()
    assert any("cut off" in p for p in verify(log.path, seals=[held]))
    store.close()


@settings(max_examples=25, deadline=None)
@given(total=st.integers(2, 12), cut=st.integers(1, 11))
def test_a_cut_off_tail_is_found_against_the_head(
    tmp_path_factory: pytest.TempPathFactory, total: int, cut: int
) -> None:
    cut = min(cut, total - 1)
    d = tmp_path_factory.mktemp("cut")
    log, lines = written(d, total)
    log.path.write_text("\n".join(lines[: total - cut]) + "\n")
    problems = verify(log.path)
    assert problems == [
        f"head file: seq {total} was sealed but the log ends at seq {total - cut} (its last {cut} entries were cut off)"
    ]


def test_a_tail_cut_together_with_its_head_file_is_still_found(tmp_path: Path) -> None:
    log, lines = written(tmp_path, 4)
    log.path.write_text("\n".join(lines[:2]) + "\n")
    head_path(log.path).unlink()
    assert [p.split(":")[0] for p in verify(log.path)] == ["head"]


def test_an_edited_removed_or_reordered_line_is_found(tmp_path: Path) -> None:
    log, lines = written(tmp_path, 5)
    cases = {
        "edited": [*lines[:2], lines[2].replace('"ok"', '"refused"'), *lines[3:]],
        "removed": [*lines[:2], *lines[3:]],
        "reordered": [lines[0], lines[2], lines[1], *lines[3:]],
    }
    for name, body in cases.items():
        log.path.write_text("\n".join(body) + "\n")
        problems = verify(log.path)
        assert problems, name
        assert {"edited": "line 3: hash", "removed": "line 3: prev", "reordered": "line 2: prev"}[name] in "\n".join(
            problems
        ), (name, problems)


def test_a_log_rewritten_from_a_point_disagrees_with_the_seal(tmp_path: Path) -> None:
    """A chain rebuilt after the last line (same length, valid hashes) is caught by the sealed hash."""
    log, lines = written(tmp_path, 3)
    seal = read_head(head_path(log.path))
    assert seal is not None
    head_path(log.path).unlink()
    log.path.write_text("\n".join(lines[:2]) + "\n")
    log.append("sandbox:delete", "tenant:t/1", "ok", target="/v1/sandboxes/s0")  # a different seq 3
    assert verify(log.path) == []  # its own new head agrees with it...
    assert verify(log.path, seals=[seal]) == ["seal: seq 3 does not have the sealed hash (the log was rewritten)"]


def test_every_append_reaches_every_sealer_in_order(tmp_path: Path) -> None:
    got: list[tuple[str, int, str]] = []
    log, lines = written(tmp_path, 3, sealers=[lambda lid, seq, h: got.append((lid, seq, h))])
    first = json.loads(lines[0])["hash"]
    assert got == [(first, i + 1, json.loads(lines[i])["hash"]) for i in range(3)]
    again = AuditLog(log.path, sealers=[lambda lid, seq, h: got.append((lid, seq, h))])  # a restart: same id
    again.append("x", "y", "ok")
    assert got[-1][:2] == (first, 4)


def test_concurrent_appends_share_one_fsync_and_each_caller_gets_its_own_line(tmp_path: Path) -> None:
    """Callers arriving while a batch is on its way to disk are written together by the next batch: one
    fsync for all of them, one chain, and every caller returns its own entry only once its line is in."""
    first_sealed, go = threading.Event(), threading.Event()

    def slow_first_seal(log_id: str, seq: int, digest: str) -> None:
        if not first_sealed.is_set():
            first_sealed.set()
            go.wait(10)

    log = AuditLog(tmp_path / "audit.jsonl", sealers=[slow_first_seal])
    got: dict[int, dict[str, Any]] = {}
    first = threading.Thread(target=lambda: got.__setitem__(-1, log.append("a", "t", "ok", target="first")))
    first.start()
    poll(first_sealed.is_set, 10, 0.002, what="the first batch to reach its seal")
    late = [
        threading.Thread(target=lambda i=i: got.__setitem__(i, log.append("a", "t", "ok", target=f"late{i}")))
        for i in range(7)
    ]
    for t in late:
        t.start()
    poll(lambda: len(log._queue) == 7, 10, 0.002, what="seven callers queued behind the batch being written")
    assert got == {}  # nobody has returned before its line is durable
    go.set()
    for t in [first, *late]:
        t.join(10)
    assert log.batches == 2
    assert verify(log.path) == []
    lines = [json.loads(x) for x in log.path.read_text().splitlines()]
    assert [e["seq"] for e in lines] == list(range(1, 9))
    assert {got[i]["target"]: got[i]["seq"] for i in got} == {e["target"]: e["seq"] for e in lines}
    head = read_head(head_path(log.path))
    assert head is not None and head["seq"] == 8


def test_a_failed_batch_fails_every_caller_in_it_and_the_next_batch_still_chains(tmp_path: Path) -> None:
    calls = {"n": 0}

    def failing_once(log_id: str, seq: int, digest: str) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError("the seal's storage is gone")

    log = AuditLog(tmp_path / "audit.jsonl", sealers=[failing_once])
    with pytest.raises(OSError, match="seal's storage"):
        log.append("a", "t", "ok", target="x")
    entry = log.append("a", "t", "ok", target="y")
    assert entry["seq"] == 2 and verify(log.path) == []


def test_appends_from_the_event_loop_and_from_threads_share_one_chain(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.jsonl")

    async def many() -> list[dict[str, Any]]:
        return await asyncio.gather(*(log.append_async("a", "t", "ok", target=f"async{i}") for i in range(20)))

    threads = [
        threading.Thread(target=log.append, args=("a", "t", "ok"), kwargs={"target": f"sync{i}"}) for i in range(5)
    ]
    for t in threads:
        t.start()
    entries = asyncio.run(many())
    for t in threads:
        t.join(10)
    assert verify(log.path) == []
    lines = [json.loads(x) for x in log.path.read_text().splitlines()]
    assert len(lines) == 25 and [e["seq"] for e in lines] == list(range(1, 26))
    assert sorted(e["target"] for e in entries) == sorted(f"async{i}" for i in range(20))
    by_seq = {e["seq"]: e for e in lines}
    assert all(by_seq[e["seq"]] == e for e in entries)  # each caller got exactly its own line back
